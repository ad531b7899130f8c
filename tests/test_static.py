"""The static-shape form (models/static_llama.py) and its runner (recipes/running/static_runner.py, shipped as
run_static.py): the same model as the dynamic module, and the same tokens through the ExecuTorch runtime."""
import pytest
import torch


def _dynamic_and_static(checkpoint, context: int, max_outputs: int | None):
    from models.llama import ExportOptions, build_exportable
    from recipes.lowering.static_program import static_form

    dynamic = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa"))
    base = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa-slice"))
    return dynamic, static_form(base, {"max_linear_outputs": max_outputs})


def test_static_logits_equal_dynamic_on_the_evaluation_text(tiny_checkpoint):
    """fp32: every position's logits of the evaluation text, in chunks of 8 (the last one padded) or token by token
    as a program's session gets them, equal the dynamic module's; so do a prefill's (its last real token's logits
    selected by last_valid_token_pos) and the decode steps after it; linears split to 8 outputs compute the same."""
    from recipes.evaluation import fidelity
    from recipes.running.generate import eager_step
    from recipes.lowering.static_program import eager_session

    context = 48
    dynamic, static = _dynamic_and_static(tiny_checkpoint, context, 8)
    assert any(type(m).__name__ == "SplitLinear" for m in static.modules())
    ids = fidelity.eval_token_ids(tiny_checkpoint.tokenizer)[:context]
    expected = fidelity.sequence_logits(eager_step(dynamic), ids, context)
    one_by_one = eager_session(static, 8)
    one_by_one.every_position = False
    for session in (eager_session(static, 8), one_by_one):
        stepped = fidelity.sequence_logits(session.step, ids, context)
        assert stepped.shape == expected.shape
        assert (stepped - expected).abs().max().item() < 1e-4
    session = eager_session(static, 8)
    prefix = 13  # a prefill of one full chunk and a padded one, then decode steps
    decoded = [session.feed(ids[:prefix])] + [session.feed([t]) for t in ids[prefix:context]]
    assert session.position == context  # the last position runs too, though its K/V has no cache slot
    assert (torch.stack(decoded[:-1]) - expected[prefix - 1:]).abs().max().item() < 1e-4


def test_twelve_layers_caches_go_where_the_specs_say_unlike_executorchs_own_script(tiny_checkpoint):
    """From 11 layers, ExecuTorch 1.5.1's export script sorts its cache names as strings and pairs a layer's input
    cache with another layer's output in its kv cache specs (docs/coreml.md); Lowerbench's specs pair each layer with
    itself, and a session that places the caches by them computes the dynamic module's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from executorch.examples.apple.coreml.llama.export_static_llm_coreml import _create_example_inputs, _get_metadata
    from executorch.examples.models.llama.model_args import ModelArgs
    from recipes.lowering.static_program import eager_session, static_metadata
    from recipes.running.generate import eager_step

    layers, context = 12, 16
    config = LlamaConfig(vocab_size=tiny_checkpoint.config.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    checkpoint = type("Checkpoint", (), {"config": config, "state_dict": LlamaForCausalLM(config).state_dict()})
    dynamic, static = _dynamic_and_static(checkpoint, context, None)
    ours = static_metadata(static, 4)["decode_kv_cache_specs"]
    assert ours[:, :4].tolist() == [[4 + i, 1 + i, 4 + layers + i, 1 + layers + i] for i in range(layers)]
    args = ModelArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=config.vocab_size,
                     max_context_len=context, generate_full_logits=False)
    args.attention_type = "static_mha"
    inputs, cache_len = _create_example_inputs(args, 1, context, torch.float32, cache_len=context - 1)
    theirs = _get_metadata(args, inputs, 1, cache_len, torch.float32)["kv_cache_specs"]
    assert theirs[2, :2].tolist() == [4 + 10, 1 + 2] and not torch.equal(theirs, ours)
    session = eager_session(static, 4)
    session.every_position = False
    ids = [3 + i % (config.vocab_size - 3) for i in range(context)]
    expected = eager_step(dynamic)(torch.tensor([ids]), torch.tensor([0]))[0]
    assert (session.step(torch.tensor([ids]), torch.tensor([0]))[0] - expected).abs().max().item() < 1e-4


def _load_shipped_runner(folder):
    """The folder's run_static.py as a module: the file a user runs, not the repository's copy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_static_shipped", folder / "run_static.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_static_twin(tiny_llama_dir, tmp_path_factory):
    """xnnpack-static-fp32 on the tiny Llama through run(), as the CLI runs it, its linears split to 32 outputs as
    a real model's wide ones are."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("static-twin")
    summary = run(RunRequest(recipes=["xnnpack-static-fp32"], out_dir=out, model=str(tiny_llama_dir), max_seq_len=64,
                             max_new_tokens=6, prompt="what is the capital ?",
                             options={"prefill_chunk": 4, "max_linear_outputs": 32}))
    return out, summary.recipes[0]


def test_twin_driven_by_run_static_gives_eager_fp32_tokens(tiny_static_twin, tiny_checkpoint):
    """The shipped run_static.py on the .pte (ExecuTorch runtime, XNNPACK): the prompt prefilled in chunks of 4, then
    greedy decode, gives the eager fp32 reference's tokens; so does the pipeline's own run of it."""
    from models.prompting import prompt_token_ids

    out, report = tiny_static_twin
    assert not report.errors, report.errors
    reference, runtime = report.generations[0], report.generations[-1]
    assert (reference.engine, runtime.engine) == ("eager-fp32", "executorch-runtime")
    assert runtime.tokens == reference.tokens
    assert report.fidelity.top1_agreement_percent == 100.0 and report.fidelity.engine == "executorch-runtime"
    shipped = _load_shipped_runner(out)
    session = shipped.runtime_session(out / "model.pte")
    ids = shipped.chat_prompt_ids(tiny_checkpoint.tokenizer, "what is the capital ?")
    assert ids == prompt_token_ids(tiny_checkpoint.tokenizer, "what is the capital ?") and len(ids) > 4
    result = shipped.generate(session, ids, 6, set(session.stop_ids))
    assert result["tokens"] == reference.tokens
    assert report.delegation.methods == ["forward", "prefill"]
    assert {o.op: o for o in report.delegation.ops}["aten_linear_default"].non_delegated == 0


def test_folder_ships_run_static_and_the_card_explains_it(tiny_static_twin):
    from pathlib import Path

    from executorch.runtime import Runtime

    from recipes.output.publish import model_card

    out, report = tiny_static_twin
    shipped = (out / "run_static.py").read_bytes()
    assert shipped == (Path(__file__).resolve().parent.parent / "recipes" / "running" / "static_runner.py").read_bytes()
    methods = Runtime.get().load_program(str(out / "model.pte")).method_names
    assert {"prefill", "forward", "prefill_kv_cache_specs", "decode_mask_specs", "freqs_cos",
            "get_max_seq_len"} <= methods
    assert "TextLLMRunner" in report.runner_note and report.profile_note
    card = model_card(report, None)
    assert "python run_static.py --prompt" in card and "cannot drive it" in card
    assert "StaticAttentionIOManager" in card and "[1, 2, 63, 16] per layer" in card
    assert "ran `run_static.py`'s loop on this very file here" in card
    assert "llama_main --model_path" not in card


def test_static_programs_have_no_symbolic_dimension(tiny_checkpoint):
    """Both methods' inputs and outputs have fixed sizes: the form a Neural Engine compiles."""
    from models.llama import ExportOptions, build_exportable
    from recipes.lowering.static_program import export_methods, static_form

    base = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, attention="sdpa-slice"))
    programs = export_methods(static_form(base, {}), 8)
    assert list(programs) == ["forward", "prefill"]
    for name, program in programs.items():
        shapes = [n.meta["val"].shape for n in program.graph.nodes if n.op in ("placeholder", "output")
                  and isinstance(n.meta.get("val"), torch.Tensor)]
        assert shapes and all(isinstance(d, int) for shape in shapes for d in shape), name
        assert not program.range_constraints, name


# The built-in model's widths (vocabulary, hidden, heads, MLP) with fewer layers: the Neural Engine program's
# structure (splits, methods, delegation per layer) is the built-in model's, and Core ML cannot run it here anyway.
BUILTIN_SHAPED_LAYERS = 2


@pytest.fixture(scope="module")
def builtin_shaped_ane_c4w(tmp_path_factory):
    """coreml-ane-c4w, export only (minmax, the quickest algorithm: the program is the same), on a random checkpoint
    with the built-in model's published config but BUILTIN_SHAPED_LAYERS layers."""
    from models.sources.random_checkpoint import write_random_checkpoint
    from recipes.request import RunRequest
    from recipes.pipeline.run import run
    from zoo.entries import load_entries

    builtin = next(entry for entry in load_entries().values() if entry.builtin)
    folder = write_random_checkpoint({**builtin.config, "num_hidden_layers": BUILTIN_SHAPED_LAYERS},
                                     tmp_path_factory.mktemp("builtin-shaped") / "model")
    out = tmp_path_factory.mktemp("builtin-ane")
    summary = run(RunRequest(recipes=["coreml-ane-c4w"], out_dir=out, model=str(folder), max_seq_len=256,
                             generate=False, options={"quant_algorithm": "minmax"}))
    return out, summary.recipes[0]


def test_builtin_shaped_ane_c4w_has_both_static_methods_with_every_linear_in_core_ml(builtin_shaped_ane_c4w):
    from executorch.runtime import Runtime

    out, report = builtin_shaped_ane_c4w
    assert not report.errors, report.errors
    program = Runtime.get().load_program(str(out / "model.pte"))
    assert {"prefill", "forward"} <= program.method_names
    layers, kv_heads, head_dim = BUILTIN_SHAPED_LAYERS, 3, 64
    for method, tokens in (("prefill", 32), ("forward", 1)):
        meta = program.metadata(method)
        sizes = [list(meta.input_tensor_meta(i).sizes()) for i in range(meta.num_inputs())]
        assert sizes[:4] == [[1, tokens], [1, tokens, 255 + tokens], [tokens, head_dim // 2], [tokens, head_dim // 2]]
        assert sizes[4:] == [[1, kv_heads, 255, head_dim]] * (2 * layers) + [[1]]
    metadata = report.llm_metadata
    assert metadata.enable_dynamic_shape is False and metadata.prefill_input_len == 32
    assert (metadata.n_heads_per_cache, metadata.head_dim, metadata.decode_input_len) == (kv_heads, head_dim, 1)
    ops = {o.op: o for o in report.delegation.ops}
    # 7 linears a layer, gate and up split in two (1536 outputs), the output layer in 48 (49152): per method
    linears = layers * 9 + 48
    assert ops["aten_linear_default"].delegated == 2 * linears and ops["aten_linear_default"].non_delegated == 0
    # the attention written out (two matmuls and a softmax a layer), no fused SDPA (wrong on iOS 26)
    assert (ops["aten_matmul_default"].delegated, ops["aten_softmax_int"].delegated) == (4 * layers, 2 * layers)
    assert "aten_scaled_dot_product_attention_default" not in ops
    for norm_op in ("aten_rsqrt_default", "aten_mean_dim"):
        assert ops[norm_op].non_delegated == 0 and ops[norm_op].delegated == 2 * (2 * layers + 1)
    assert {o.op for o in report.delegation.ops if o.non_delegated} <= {"getitem"}
    assert report.recipe.options["compute_units"] == "cpu_and_ne"


def test_builtin_shaped_ane_program_attends_without_fused_sdpa_or_copied_kv_heads(builtin_shaped_ane_c4w, tmp_path):
    """The MIL program coremltools built, one function per method: each layer's attention is written out over
    grouped query heads (3 kv heads serving 9), with no tile or repeat of the kv heads."""
    from tests.test_coreml import assert_attention_written_out, mil_ops

    out, _report = builtin_shaped_ane_c4w
    functions = mil_ops((out / "model.pte").read_bytes(), tmp_path)
    assert set(functions) == {"forward", "prefill"}
    assert_attention_written_out(functions, BUILTIN_SHAPED_LAYERS)


@pytest.fixture(scope="module")
def builtin_static_twin(tmp_path_factory):
    """xnnpack-static-fp32 on the built-in model, export only: the tests drive it as a user does."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("builtin-twin")
    summary = run(RunRequest(recipes=["xnnpack-static-fp32"], out_dir=out, max_seq_len=256, generate=False))
    return out, summary.recipes[0]


@pytest.mark.builtin
def test_builtin_twin_answers_paris_through_run_static(builtin_static_twin):
    """run_static.py's loop on the built-in model's twin gives the eager fp32 model's greedy tokens, in process and
    as the shipped script run from the folder, which answers the default prompt with Paris."""
    import subprocess
    import sys

    from models.sources.checkpoint import load_checkpoint
    from models.llama import ExportOptions, build_exportable
    from recipes.running import generate as gen

    out, report = builtin_static_twin
    assert not report.errors, report.errors
    checkpoint = load_checkpoint(None)
    module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(256, attention="sdpa"),
                              tie_output=True)
    reference = gen.generate(gen.eager_step(module), gen.ENGINE_EAGER_FP32, checkpoint.tokenizer, gen.DEFAULT_PROMPT,
                             12, 256, stop_ids=checkpoint.eos_token_ids)
    shipped = _load_shipped_runner(out)
    session = shipped.runtime_session(out / "model.pte")
    result = shipped.generate(session, shipped.chat_prompt_ids(checkpoint.tokenizer, gen.DEFAULT_PROMPT), 12,
                              set(session.stop_ids))
    assert result["tokens"] == reference.tokens and "Paris" in reference.text
    answer = subprocess.run([sys.executable, str(out / "run_static.py"), "--max-new-tokens", "12"], cwd=out,
                            capture_output=True, text=True, timeout=600)
    assert answer.returncode == 0, answer.stderr[-2000:]
    assert "Paris" in answer.stdout
