"""Each Llama-like family (models/families/) against transformers' own model of it: a tiny random checkpoint made with
the family's config class and saved by transformers, loaded through Lowerbench's loading path, gives transformers'
logits in fp32 eager (separate and fused q/k/v), its xnnpack-fp32 program gives eager's greedy text on the ExecuTorch
runtime and in ExecuTorch's LLM runner (where its program differs from a Llama's), and a norm on q and k heads lowers
through xnnpack-8da4w, Core ML and QNN."""
import json
from pathlib import Path

import pytest
import torch

from models.errors import UserFacingError
from tests.conftest import _byte_level_tokenizer

PROMPT_TOKENS = 64
SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _configs(vocab_size: int) -> dict:
    import transformers as t

    sizes = dict(SIZES, vocab_size=vocab_size)
    rotary = int(sizes["head_dim"] * 0.75) // 2
    return {
        "qwen2": t.Qwen2Config(**sizes, tie_word_embeddings=True),
        "qwen3": t.Qwen3Config(**sizes, tie_word_embeddings=True),
        "smollm3": t.SmolLM3Config(**sizes, no_rope_layers=[1, 0]),
        "mistral": t.MistralConfig(**sizes, sliding_window=256),
        "granite": t.GraniteConfig(**sizes, tie_word_embeddings=True, embedding_multiplier=12.0,
                                   residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=4.0),
        # Phi-4-mini's shape of rope: three quarters of each head rotated, longrope factors
        "phi3": t.Phi3Config(**dict(sizes, max_position_embeddings=1024), partial_rotary_factor=0.75,
                             original_max_position_embeddings=256,
                             rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 256,
                                           "short_factor": [1.0 + 0.25 * i for i in range(rotary)],
                                           "long_factor": [4.0 + i for i in range(rotary)]}),
    }


FAMILIES = ("qwen2", "qwen3", "smollm3", "mistral", "granite", "phi3")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    """family -> a tiny random checkpoint folder written by transformers' save_pretrained, its norms and biases
    away from their initial ones and unit, so a weight read into the wrong place shows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = _byte_level_tokenizer()
    folders = {}
    for name, config in _configs(len(tokenizer)).items():
        folder = tmp_path_factory.mktemp(f"family-{name}")
        tokenizer.save_pretrained(folder)
        config.save_pretrained(folder)
        # a family's tokenizer class may add a special token of its own as it loads: the vocabulary is the loaded one,
        # so the model emits no id the tokenizer lacks
        config.vocab_size = max(AutoTokenizer.from_pretrained(folder).get_vocab().values()) + 1
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("bias"):
                    parameter.normal_(0.0, 0.2)
                elif "norm" in parameter_name:
                    parameter.normal_(1.0, 0.2)
        model.save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="module")
def family_checkpoints(family_dirs) -> dict:
    from models.sources.checkpoint import load_checkpoint

    return {name: load_checkpoint(str(folder)) for name, folder in family_dirs.items()}


def test_each_family_file_declares_its_architecture_and_the_checkpoints_find_it(family_checkpoints):
    from models.families import families

    assert set(FAMILIES) | {"llama"} <= set(families())
    for name, checkpoint in family_checkpoints.items():
        assert checkpoint.describe()["family"] == name
        assert checkpoint.architecture in families()[name].architectures


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_eager_logits_match_transformers_on_a_64_token_prompt(family, family_dirs, family_checkpoints):
    from transformers import AutoModelForCausalLM

    from models.llama import ExportOptions, build_exportable

    reference = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32).eval()
    checkpoint = family_checkpoints[family]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, checkpoint.config.vocab_size, (1, PROMPT_TOKENS), generator=generator)
    with torch.no_grad():
        expected = reference(tokens).logits
        for form in (dict(attention="sdpa"), dict(attention="custom", fuse_qkv=True),
                     dict(attention="custom", fuse_qkv=True, norm="linear-mean")):
            module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(PROMPT_TOKENS, **form))
            # a prefill, then two decode steps from the module's own cache
            got = torch.cat([module(tokens[:, :-2], torch.tensor([0])),
                             module(tokens[:, -2:-1], torch.tensor([PROMPT_TOKENS - 2])),
                             module(tokens[:, -1:], torch.tensor([PROMPT_TOKENS - 1]))], dim=1)
            assert (got - expected).abs().max().item() <= 1e-4, (family, form)


# The families whose program differs from a Llama's (a bias, a norm on q and k, layers without rope, partial rope);
# Granite's folds and Mistral's window within the context leave a Llama's program, which the Llama tests run.
RUNTIME_FAMILIES = ("qwen2", "qwen3", "smollm3", "phi3")
PROMPT = "what is the capital of France ?"


def _lowered_folder(checkpoint, folder, recipe_name: str, options: dict):
    """The recipe's program of the checkpoint at a context of 64, written with the tokenizer as a device app's
    folder: (eager module, lowered program, recipe)."""
    import shutil

    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe

    recipe = get_recipe(recipe_name)
    made = prepare_and_lower(RecipeJob(recipe, options, checkpoint, 64))
    (folder / "model.pte").write_bytes(made.lowered.pte)
    shutil.copy(Path(checkpoint.path) / "tokenizer.json", folder / "tokenizer.json")
    return made.module, made.lowered, recipe


@pytest.fixture(scope="module")
def family_fp32_programs(family_checkpoints, tmp_path_factory) -> dict:
    """family -> (folder, eager module, lowered program, recipe) of xnnpack-fp32."""
    made = {}
    for name in RUNTIME_FAMILIES:
        folder = tmp_path_factory.mktemp(f"family-{name}-fp32")
        made[name] = (folder, *_lowered_folder(family_checkpoints[name], folder, "xnnpack-fp32", {}))
    return made


@pytest.mark.slow
@pytest.mark.xdist_group("families")  # the programs are made once, on one worker
@pytest.mark.parametrize("family", RUNTIME_FAMILIES)
def test_xnnpack_fp32_on_the_runtime_and_in_the_llm_runner_gives_eagers_greedy_text(family, family_fp32_programs,
                                                                                   family_checkpoints):
    from recipes.running.generate import eager_step, generate, load_runtime_method, runtime_step
    from recipes.running.llm_runner import generate_with_runner

    folder, module, lowered, recipe = family_fp32_programs[family]
    checkpoint = family_checkpoints[family]
    assert lowered.delegation.delegated_nodes > 0
    tokenizer = checkpoint.tokenizer
    step = runtime_step(load_runtime_method(lowered.pte, recipe.backend.runtime_imports))
    runtime = generate(step, "executorch-runtime", tokenizer, PROMPT, max_new_tokens=12, max_seq_len=64)
    module.reset_cache()
    eager = generate(eager_step(module), "eager-fp32", tokenizer, PROMPT, max_new_tokens=12, max_seq_len=64)
    assert runtime.new_tokens == eager.new_tokens > 0
    assert runtime.tokens == eager.tokens and runtime.text == eager.text
    runner = generate_with_runner(folder / "model.pte", folder / "tokenizer.json", tokenizer, PROMPT,
                                  max_new_tokens=12, eos_token_ids=checkpoint.eos_token_ids,
                                  runtime_imports=recipe.backend.runtime_imports)
    assert runner.pieces == [tokenizer.decode([token]) for token in eager.tokens]  # special tokens' text included


@pytest.mark.slow
def test_xnnpack_8da4w_folder_generates_in_executorchs_llm_runner(family_checkpoints, tmp_path):
    """int4 linears and dynamically quantized activations beside a norm on q and k heads (minmax: the quickest
    algorithm)."""
    from recipes.running.llm_runner import generate_with_runner

    checkpoint = family_checkpoints["qwen3"]
    _module, lowered, recipe = _lowered_folder(checkpoint, tmp_path, "xnnpack-8da4w", {"quant_algorithm": "minmax"})
    assert lowered.delegation.delegated_nodes > 0
    generation = generate_with_runner(tmp_path / "model.pte", tmp_path / "tokenizer.json", checkpoint.tokenizer,
                                      PROMPT, max_new_tokens=8, eos_token_ids=checkpoint.eos_token_ids,
                                      runtime_imports=recipe.backend.runtime_imports)
    assert generation.new_tokens > 0 and len(generation.pieces) == generation.new_tokens


@pytest.mark.parametrize("family", ["qwen3", "phi3", "smollm3"])
def test_the_static_form_computes_the_modules_logits(family, family_checkpoints):
    """The Neural Engine's static form calls the attention's own projection, q/k norm and rope step."""
    from models.llama import ExportOptions, build_exportable
    from models.static_llama import StaticLlama

    checkpoint = family_checkpoints[family]
    module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(32))
    tokens = torch.randint(3, checkpoint.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = module(tokens, torch.tensor([0]))
        static = StaticLlama(module)
        inputs = list(static.example_inputs(8))
        inputs[0] = tokens.to(torch.int32)
        mask = torch.full((8, static.cache_len + 8), float("-inf"))
        mask[:, static.cache_len:] = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
        inputs[1] = mask[None]
        for last in (7, 5):  # each position's logits, selected by last_valid_token_pos
            inputs[-1] = torch.tensor([last])
            logits, _k, _v = static(*inputs)
            assert (logits[:, 0] - expected[:, last]).abs().max().item() <= 1e-5


def _write_config(folder, config: dict):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config", [
    {"architectures": ["MambaForCausalLM"], "model_type": "mamba"},
    {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
], ids=["mamba", "qwen3-moe", "mixtral"])
def test_a_state_space_or_mixture_of_experts_config_is_refused_listing_the_families(config, tmp_path):
    from models.families import families
    from models.sources.checkpoint import load_checkpoint

    folder = _write_config(tmp_path / "model", config)
    with pytest.raises(UserFacingError) as refused:
        load_checkpoint(str(folder))
    message = str(refused.value)
    assert config["architectures"][0] in message and "Choose a checkpoint" in message
    for family in families().values():
        assert family.name in message and family.architectures[0] in message


def test_a_context_beyond_a_sliding_window_is_refused(family_checkpoints):
    from models.llama import ExportOptions, build_exportable
    from recipes.registry import get_recipe
    from recipes.request import check_limits

    checkpoint = family_checkpoints["mistral"]
    with pytest.raises(UserFacingError, match="sliding attention window of 256"):
        check_limits(checkpoint.config, [get_recipe("xnnpack-fp32")], 384, {"xnnpack-fp32": {}})
    with pytest.raises(UserFacingError, match="sliding attention window of 256"):
        build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(384))
    check_limits(checkpoint.config, [get_recipe("xnnpack-fp32")], 256, {"xnnpack-fp32": {}})


def test_a_longrope_context_beyond_its_original_length_is_refused(family_checkpoints):
    from recipes.registry import get_recipe
    from recipes.request import check_limits

    with pytest.raises(UserFacingError, match="original_max_position_embeddings"):
        check_limits(family_checkpoints["phi3"].config, [get_recipe("xnnpack-fp32")], 512, {"xnnpack-fp32": {}})


@pytest.mark.slow
def test_a_norm_on_q_and_k_lowers_whole_into_core_ml(family_checkpoints):
    """Qwen3's per-head q/k norms go into the Core ML program with every linear and the attention."""
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe

    checkpoint = family_checkpoints["qwen3"]
    layers = checkpoint.config.num_hidden_layers
    delegation = prepare_and_lower(RecipeJob(get_recipe("coreml-fp16"), {}, checkpoint, 32)).lowered.delegation
    ops = {o.op: o for o in delegation.ops}
    assert ops["aten_linear_default"].delegated == layers * 7 + 1 and ops["aten_linear_default"].non_delegated == 0
    assert "aten_scaled_dot_product_attention_default" not in ops  # Core ML's attention is written out
    for op, per_layer in (("aten_matmul_default", 2), ("aten_softmax_int", 1)):
        assert ops[op].delegated == per_layer * layers and ops[op].non_delegated == 0, ops[op]
    assert ops["aten_rsqrt_default"].delegated == layers * 4 + 1 and ops["aten_rsqrt_default"].non_delegated == 0
    assert {o.op for o in delegation.ops if o.non_delegated} <= {"getitem"}


@pytest.mark.slow
def test_a_norm_on_q_and_k_lowers_into_one_qnn_program(family_checkpoints):
    """Qwen3 through QNN's PT2E quantization and partitioner: every linear (as a 1x1 convolution) in one program."""
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe
    from tests.test_qnn import needs_qnn

    if needs_qnn.args[0]:
        pytest.skip(needs_qnn.kwargs["reason"])
    checkpoint = family_checkpoints["qwen3"]
    layers = checkpoint.config.num_hidden_layers
    delegation = prepare_and_lower(RecipeJob(get_recipe("qnn-16a4w"), {}, checkpoint, 32)).lowered.delegation
    ops = {o.op: o for o in delegation.ops}
    # the hybrid program's two methods, prefill_forward and kv_forward, each hold every linear
    assert ops["aten_convolution_default"].delegated == 2 * (layers * 7 + 1)
    assert ops["aten_convolution_default"].non_delegated == 0
    assert delegation.delegated_subgraphs <= 2 * 2


def test_gguf_files_of_the_families_transformers_reads_are_taken_and_others_refused():
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from models.families import families
    from models.sources.checkpoint import check_gguf_architecture

    declared = [family.gguf_architecture for family in families().values() if family.gguf_architecture]
    assert {"llama", "qwen2", "qwen3", "phi3", "mistral"} <= set(declared) <= set(GGUF_CONFIG_MAPPING)
    for architecture in declared:
        check_gguf_architecture(architecture, "model.gguf")
    with pytest.raises(UserFacingError, match="architecture 'mamba'.*qwen3.*Hugging Face folder"):
        check_gguf_architecture("mamba", "model.gguf")


def test_the_reports_model_section_names_the_family_and_an_older_report_still_loads(family_checkpoints):
    from recipes.output.report import ModelInfo

    described = family_checkpoints["phi3"].describe()
    assert ModelInfo.from_dict(described, strict=True).to_dict() == described and described["family"] == "phi3"
    older = {key: value for key, value in described.items() if key != "family"}
    assert ModelInfo.from_dict(older, strict=True).family is None
    assert ModelInfo.from_dict(older, strict=True).to_dict() == older
