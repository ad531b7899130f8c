"""Each Llama-like family (models/families/) against transformers' own model of it: a tiny random checkpoint made with
the family's config class and saved by transformers, loaded through Lowerbench's loading path, gives transformers'
logits in fp32 eager (separate and fused q/k/v), its xnnpack-fp32 program gives eager's greedy text on the ExecuTorch
runtime, and its xnnpack-8da4w program generates in ExecuTorch's LLM runner."""
import json

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
                             original_max_position_embeddings=256, rope_scaling={"rope_type": "longrope", "original_max_position_embeddings": 256,
                                           "short_factor": [1.0 + 0.25 * i for i in range(rotary)],
                                           "long_factor": [4.0 + i for i in range(rotary)]}),
    }


FAMILIES = ("qwen2", "qwen3", "smollm3", "mistral", "granite", "phi3")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    """family -> a tiny random checkpoint folder written by transformers' save_pretrained, its norms and biases
    away from their initial ones and unit, so a weight read into the wrong place shows."""
    from transformers import AutoModelForCausalLM

    tokenizer = _byte_level_tokenizer()
    folders = {}
    # rows to spare: a family's tokenizer class may add a special token of its own when it loads the folder
    for name, config in _configs(128).items():
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if parameter_name.endswith("bias"):
                    parameter.normal_(0.0, 0.2)
                elif "norm" in parameter_name:
                    parameter.normal_(1.0, 0.2)
        folder = tmp_path_factory.mktemp(f"family-{name}")
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
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
    tokens = torch.randint(3, checkpoint.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
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


@pytest.fixture(scope="module")
def family_fp32_programs(family_checkpoints) -> dict:
    """family -> (eager module, lowered program, recipe) of xnnpack-fp32 at a context of 64."""
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-fp32")
    made = {}
    for name, checkpoint in family_checkpoints.items():
        program = prepare_and_lower(RecipeJob(recipe, {}, checkpoint, 64))
        made[name] = (program.module, program.lowered, recipe)
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_xnnpack_fp32_on_the_runtime_gives_eagers_greedy_text(family, family_fp32_programs, family_checkpoints):
    from recipes.running.generate import eager_step, generate, load_runtime_method, runtime_step

    module, lowered, recipe = family_fp32_programs[family]
    assert lowered.delegation.to_dict()["delegated_nodes"] > 0
    tokenizer = family_checkpoints[family].tokenizer
    step = runtime_step(load_runtime_method(lowered.pte, recipe.backend.runtime_imports))
    runtime = generate(step, "executorch-runtime", tokenizer, "what is the capital of France ?", max_new_tokens=12,
                       max_seq_len=64)
    module.reset_cache()
    eager = generate(eager_step(module), "eager-fp32", tokenizer, "what is the capital of France ?",
                     max_new_tokens=12, max_seq_len=64)
    assert runtime.new_tokens == eager.new_tokens == 12
    assert runtime.text == eager.text


@pytest.fixture(scope="module")
def family_8da4w_folders(family_checkpoints, family_dirs, tmp_path_factory) -> dict:
    """family -> a folder with the xnnpack-8da4w program (minmax int4, the quickest algorithm) and the tokenizer."""
    import shutil

    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-8da4w")
    folders = {}
    for name, checkpoint in family_checkpoints.items():
        folder = tmp_path_factory.mktemp(f"family-{name}-8da4w")
        lowered = prepare_and_lower(RecipeJob(recipe, {"quant_algorithm": "minmax"}, checkpoint, 64)).lowered
        (folder / "model.pte").write_bytes(lowered.pte)
        shutil.copy(family_dirs[name] / "tokenizer.json", folder / "tokenizer.json")
        folders[name] = folder
    return folders


@pytest.mark.parametrize("family", FAMILIES)
def test_xnnpack_8da4w_folder_generates_in_executorchs_llm_runner(family, family_8da4w_folders, family_checkpoints):
    from recipes.backends.xnnpack import BACKEND
    from recipes.running.llm_runner import generate_with_runner

    folder, checkpoint = family_8da4w_folders[family], family_checkpoints[family]
    generation = generate_with_runner(folder / "model.pte", folder / "tokenizer.json", checkpoint.tokenizer,
                                      "what is the capital of France ?", max_new_tokens=8,
                                      eos_token_ids=checkpoint.eos_token_ids, runtime_imports=BACKEND.runtime_imports)
    assert generation.new_tokens > 0 and generation.text


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
