"""A recipe folder is what a device app needs: model.pte with the LLM runner's metadata methods, the tokenizer
files, and sample generations from ExecuTorch's own LLM runner (TextLLMRunner) on exactly those files."""
import json

import pytest
import torch

RUNNER_ENGINE = "executorch-llm-runner"
METADATA_METHODS = {"get_max_seq_len", "get_max_context_len", "get_vocab_size", "get_bos_id", "get_eos_ids",
                    "use_kv_cache", "use_sdpa_with_kv_cache", "enable_dynamic_shape", "get_n_layers"}


def constant_methods(pte) -> dict:
    """Every method of a .pte other than forward, with the values it returns, read with the runtime's program API."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte if isinstance(pte, bytes) else str(pte))
    values = {}
    for name in set(program.method_names) - {"forward"}:
        out = program.load_method(name).execute([])
        values[name] = [int(v) for v in out] if len(out) > 1 or name == "get_eos_ids" else int(out[0])
    return values


def engines(report) -> list[str]:
    return [g.engine for g in report.generations]


def test_recipe_folder_holds_pte_tokenizer_with_chat_template_and_report(runner_llama_run, runner_llama_dir):
    folder, report = runner_llama_run
    assert {p.name for p in folder.iterdir()} == {"model.pte", "tokenizer.json", "tokenizer_config.json", "report.json",
                                                  "model.etdump", "prefill.etdump"}  # the profile's (on by default)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in config["chat_template"]
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert json.loads((folder / "report.json").read_text())["llm_metadata"] == report.llm_metadata.to_dict()


def test_runner_greedy_tokens_equal_eager_fp32_greedy_tokens(runner_llama_run, runner_llama_dir):
    from models.sources.checkpoint import load_checkpoint

    _folder, report = runner_llama_run
    assert engines(report) == ["eager-fp32", RUNNER_ENGINE, "executorch-runtime"], report.runner_note
    eager, runner, step_loop = report.generations
    tokenizer = load_checkpoint(str(runner_llama_dir)).tokenizer
    assert runner.prompt_tokens == eager.prompt_tokens and runner.prompt_note is None
    assert len(eager.tokens) == 8  # no stop token came up, so every position compares
    assert runner.pieces == [tokenizer.decode([t]) for t in eager.tokens]
    assert runner.text == eager.text == step_loop.text
    for key in ("model_load_ms", "time_to_first_token_ms", "prefill_tokens_per_s", "decode_tokens_per_s"):
        assert isinstance(getattr(runner, key), (int, float)) and getattr(runner, key) >= 0


def test_metadata_methods_match_config_tokenizer_and_generation_config(runner_llama_run, runner_llama_dir):
    from transformers import AutoConfig, AutoTokenizer

    folder, report = runner_llama_run
    config, tokenizer = AutoConfig.from_pretrained(runner_llama_dir), AutoTokenizer.from_pretrained(runner_llama_dir)
    stops = json.loads((runner_llama_dir / "generation_config.json").read_text())["eos_token_id"]
    assert len(stops) == 3
    expected = {
        "get_max_seq_len": 64, "get_max_context_len": 64, "get_vocab_size": config.vocab_size,
        "get_n_layers": config.num_hidden_layers, "get_bos_id": tokenizer.bos_token_id, "get_eos_ids": sorted(stops),
        # the XNNPACK program: one dynamic token dimension, llama::custom_sdpa over its own KV cache
        "use_kv_cache": 1, "use_sdpa_with_kv_cache": 1, "enable_dynamic_shape": 1,
    }
    assert constant_methods(folder / "model.pte") == expected
    assert {k: int(v) if isinstance(v, bool) else v for k, v in report.llm_metadata.to_dict().items()} == expected


def test_every_listed_eos_id_stops_the_step_loop(runner_llama_run, runner_llama_dir, tmp_path):
    """Stop ids taken from the model's own greedy answer, each put in a Llama-3-style list of its own:
    the generation ends right on it."""
    import shutil

    from models.sources.checkpoint import load_checkpoint
    from models.llama import ExportOptions, build_exportable
    from recipes.running import generate as gen

    greedy = runner_llama_run[1].generations[0].tokens
    for k in (2, 4, 6):
        folder = tmp_path / f"stop-{k}"
        shutil.copytree(runner_llama_dir, folder)
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5, greedy[k]]}))
        checkpoint = load_checkpoint(str(folder))
        assert set(checkpoint.eos_token_ids) == {2, 5, greedy[k]}
        module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(64, attention="sdpa"))
        out = gen.generate(gen.eager_step(module), "eager-fp32", checkpoint.tokenizer, "what is the capital of France ?",
                           8, 64, stop_ids=checkpoint.eos_token_ids)
        first = greedy.index(greedy[k])
        assert out.tokens == greedy[: first + 1]


def test_runner_stops_on_an_eos_id_that_is_not_the_tokenizers(runner_llama_run, runner_llama_dir, tmp_path):
    from models.sources.checkpoint import load_checkpoint
    from models.llama import build_exportable
    from recipes.lowering.llm_metadata import llm_metadata
    from recipes.running.llm_runner import generate_with_runner
    from recipes.lowering.lower import Lowering, export_program, lower_for_backend
    from recipes.registry import get_recipe

    folder, report = runner_llama_run
    greedy = report.generations[0].tokens
    # A token that first comes up after the first one: the runner checks for a stop only in its decode loop,
    # never on the token its prefill gives.
    stop = next(t for k, t in enumerate(greedy) if k >= 2 and greedy.index(t) == k)
    checkpoint = load_checkpoint(str(runner_llama_dir))
    recipe = get_recipe("xnnpack-fp32")
    module = build_exportable(checkpoint.config, checkpoint.state_dict, recipe.export_options(64))
    program = export_program(module, 64, strict=recipe.backend.strict_export)
    metadata = llm_metadata(program, 64, checkpoint.config, checkpoint.tokenizer, [2, stop])
    pte = tmp_path / "model.pte"
    lowered = lower_for_backend(program, recipe, {}, Lowering(constant_methods=metadata))
    pte.write_bytes(lowered.pte)
    out = generate_with_runner(pte, folder / "tokenizer.json", checkpoint.tokenizer, "what is the capital of France ?",
                               8, eos_token_ids=[2, stop])
    first = greedy.index(stop)
    assert out.pieces == [checkpoint.tokenizer.decode([t]) for t in greedy[: first + 1]]


def test_step_loop_generation_shown_with_the_reason_when_the_runner_cannot_load_the_tokenizer(tiny_fp32_run):
    """The tiny Llama's word-level tokenizer (Whitespace pre-tokenizer) is one ExecuTorch's runner does not load."""
    folder, report = tiny_fp32_run
    assert engines(report) == ["eager-fp32", "executorch-runtime"]
    assert "runner" in report.runner_note and "\n" not in report.runner_note
    assert (folder / "tokenizer.json").is_file() and (folder / "model.pte").is_file()


def test_metadata_of_a_static_one_token_program(tiny_qnn_16a4w):
    """QNN's program: one token per call, caches written in place, no custom SDPA."""
    from recipes.lowering.llm_metadata import llm_metadata

    checkpoint, program, _module = tiny_qnn_16a4w
    metadata = llm_metadata(program, 32, checkpoint.config, checkpoint.tokenizer, [2])
    assert metadata["enable_dynamic_shape"] is False and metadata["use_kv_cache"] is True
    assert metadata["use_sdpa_with_kv_cache"] is False
    assert metadata["get_vocab_size"] == checkpoint.config.vocab_size and metadata["get_max_seq_len"] == 32


@pytest.mark.builtin
def test_builtin_8da4w_folder_runs_in_the_llm_runner_and_answers_paris(builtin_8da4w_run):
    from transformers import AutoTokenizer

    from recipes.running.generate import DEFAULT_PROMPT
    from recipes.running.llm_runner import generate_with_runner

    folder, report, _shown = builtin_8da4w_run
    assert {"model.pte", "tokenizer.json", "tokenizer_config.json", "report.json"} <= {p.name for p in folder.iterdir()}
    runner = next(g for g in report["generations"] if g["engine"] == RUNNER_ENGINE)
    assert "Paris" in runner["text"] and runner["prompt_note"] is None
    assert runner["model_load_ms"] > 0 and runner["decode_tokens_per_s"] > 0 and runner["prefill_tokens_per_s"] > 0
    assert runner["time_to_first_token_ms"] > 0
    step_loop = next(g for g in report["generations"] if g["engine"] == "executorch-runtime")
    assert runner["text"] == step_loop["text"]
    # The folder alone, as a user would take it: its tokenizer files give the chat template.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos_ids = constant_methods(folder / "model.pte")["get_eos_ids"]
    assert tokenizer.eos_token_id in eos_ids
    again = generate_with_runner(folder / "model.pte", folder / "tokenizer.json", tokenizer, DEFAULT_PROMPT,
                                 runner["new_tokens"], eos_token_ids=eos_ids)
    assert again.text == runner["text"]
