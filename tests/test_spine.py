"""The spine: checkpoint -> exportable module -> ExportedProgram -> XNNPACK .pte -> runtime generation."""
import hashlib
import json

import pytest
import torch

from models.errors import UserFacingError
from tests.conftest import run_cli, run_main


def test_fp32_runtime_logits_match_eager(tiny_fp32_lowered):
    from recipes.running.generate import load_runtime_method

    module, lowered, recipe = tiny_fp32_lowered
    tokens = torch.tensor([[3, 5, 7, 2, 9, 4]])
    module.reset_cache()
    with torch.no_grad():
        eager = module(tokens, torch.tensor([0]))
    _program, method = load_runtime_method(lowered.pte, recipe.backend.runtime_imports)
    runtime = method.execute([tokens, torch.tensor([0])])[0]
    assert runtime.shape == eager.shape
    assert (runtime - eager).abs().max().item() < 1e-4
    assert torch.equal(runtime.argmax(-1), eager.argmax(-1))
    # decode continues from the runtime's own KV cache
    module_next = module(torch.tensor([[6]]), torch.tensor([6]))
    runtime_next = method.execute([torch.tensor([[6]]), torch.tensor([6])])[0]
    assert (runtime_next - module_next).abs().max().item() < 1e-4


def test_module_matches_transformers(tiny_llama_dir, tiny_checkpoint):
    from transformers import LlamaForCausalLM

    from models.llama import ExportOptions, build_exportable

    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tokens = torch.tensor([[1, 4, 6, 8, 3]])
    with torch.no_grad():
        expected = reference(tokens).logits
        forms = [dict(attention="sdpa"), dict(attention="custom", norm="linear-mean", fuse_qkv=True),
                 dict(attention="custom", fuse_qkv=True)]
        for form in forms:
            module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, **form))
            prefill = module(tokens[:, :3], torch.tensor([0]))
            step1 = module(tokens[:, 3:4], torch.tensor([3]))
            step2 = module(tokens[:, 4:5], torch.tensor([4]))
            got = torch.cat([prefill, step1, step2], dim=1)
            assert (got - expected).abs().max().item() < 1e-4, form


def test_delegation_table_of_fp32(tiny_fp32_lowered):
    _module, lowered, _recipe = tiny_fp32_lowered
    table = lowered.delegation
    ops = {o.op: o for o in table.ops}
    # One partition per gap between ExecuTorch's attention ops (update_cache, custom_sdpa), which stay
    # outside XNNPACK: norms, projections, rope, MLP and the views between them all inside.
    assert table.delegated_subgraphs == 2 + 1
    # per layer 5 projections (q/k/v fused, o, gate, up, down), 1 rope rotation and 2 norms' mean of squares,
    # plus the final norm's and lm_head
    assert ops["aten_linear_default"].delegated == 2 * (5 + 1 + 2) + 1 + 1
    # XNNPACK's mean would bring layout changes with it; the norms compute theirs as a linear
    assert "aten_mean_dim" not in ops
    assert ops["aten_linear_default"].non_delegated == 0
    # read before to_executorch: no memory-planning nodes counted as undelegated ops
    assert not [o for o in table.ops if "alloc" in o.op]


def test_cli_run_writes_report_and_pte(tiny_llama_dir, tmp_path):
    """`python -m recipes run --recipe A --recipe B` does what the app's Lower does with two recipes."""
    out = tmp_path / "out"
    result = run_cli("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--recipe", "xnnpack-8da4w",
                     "--out", str(out), "--max-seq-len", "64", "--max-new-tokens", "6", "--prompt", "what is the capital ?")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((out / "summary.json").read_text())
    assert [row["recipe"] for row in rows] == ["xnnpack-fp32", "xnnpack-8da4w"]
    assert (out / "xnnpack-fp32" / "model.pte").is_file() and (out / "xnnpack-fp32" / "report.json").is_file()
    out = out / "xnnpack-8da4w"
    report = json.loads((out / "report.json").read_text())
    pte = (out / "model.pte").read_bytes()
    assert report["pte"]["sha256"] == hashlib.sha256(pte).hexdigest()
    assert report["pte"]["bytes"] == len(pte)
    kv_cache = report["recipe"].pop("kv_cache")
    assert (kv_cache["dtype"], kv_cache["window"], kv_cache["rows"], kv_cache["tokens_per_call"]) == ("fp32", None, 64, 64)
    assert report["recipe"] == {"name": "xnnpack-8da4w", "backend": "xnnpack", "quantization": "8da4w",
                                "options": {"group_size": 32, "quant_algorithm": "awq",
                                            "mixed_precision_budget": 0.0, "kv_cache": "fp32",
                                            "kv_cache_window": 0}, "max_seq_len": 64,
                                "runs_on": "any CPU with the ExecuTorch runtime: Linux, macOS, Windows, Android, iOS"}
    assert report["model"]["source"] == "local-folder" and report["model"]["architecture"] == "LlamaForCausalLM"
    assert set(report["versions"]) >= {"torch", "executorch", "torchao", "transformers"}
    assert set(report["timings_s"]) >= {"load", "quantize", "export", "lower", "serialize", "peak_rss_mb"}
    # the default algorithm, AWQ, searched each decoder layer on the calibration text as the module was built
    assert report["quantization"]["calibration"]["tokens"] == 512 and report["timings_s"]["quant_algorithm"] > 0
    from recipes.process import thread_policy

    share = thread_policy.cores_share()  # the suite's workers are given their share of the cores (conftest.py)
    assert report["threads"] == {"openmp_default": "1", "openmp_default_set_by": "lowerbench",
                                 "torch_intra_op": share or thread_policy.physical_cores(),
                                 "torch_during_runtime_calls": 1, **({"cores_share": share} if share else {})}
    engines = [g["engine"] for g in report["generations"]]
    assert engines == ["eager-fp32", "executorch-runtime"]
    assert report["generations"][1]["decode_tokens_per_s"] >= 0
    linear = {o["op"]: o for o in report["delegation"]["ops"]}["aten_linear_default"]
    # per layer 5 projections, 1 rope rotation, 2 norms; the final norm and lm_head
    assert linear["non_delegated"] == 0 and linear["delegated"] == 2 * (5 + 1 + 2) + 1 + 1
    assert report["errors"] == []
    assert not list(out.glob(".*partial"))
    # the memory estimate counted the fidelity texts with this model's own tokenizer
    from transformers import AutoTokenizer

    from recipes.evaluation import fidelity

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert report["memory"]["estimate"]["eval_tokens"] == [
        len(fidelity.eval_token_ids(tokenizer, path)) for path in (fidelity.EVAL_TEXT, fidelity.HELDOUT_TEXT)]


def test_cli_export_only_writes_the_pte_without_generating(tiny_llama_dir, tmp_path):
    from recipes.running.generate import load_runtime_method
    from recipes.backends.xnnpack import BACKEND

    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-8da4w", "--out", str(out),
                      "--max-seq-len", "64", "--export-only")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["generations"] == [] and report["fidelity"] is None and "export only" in report["generation_note"]
    assert "reference_generation" not in report["timings_s"] and report["delegation"]["delegated_subgraphs"] == 3
    assert report["pte"]["sha256"] == hashlib.sha256((out / "model.pte").read_bytes()).hexdigest()
    _program, method = load_runtime_method(out / "model.pte", BACKEND.runtime_imports)
    import torch

    logits = method.execute([torch.tensor([[1, 2, 3]]), torch.tensor([0])])[0]
    assert logits.shape[:2] == (1, 3) and torch.isfinite(logits).all()


def test_cli_unknown_recipe_fails_cleanly(tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", "--recipe", "xnnpack-int3", "--out", str(out))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown recipe 'xnnpack-int3'")
    assert not (out / "model.pte").exists()


def test_cli_list_names_recipes():
    result = run_cli("list")
    assert result.returncode == 0
    assert "xnnpack-fp32" in result.stdout and "xnnpack-8da4w" in result.stdout


def _write_folder(folder, config: dict, weights: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights is not None:
        from safetensors.torch import save_file

        save_file(weights, folder / "model.safetensors")
    return folder


def test_non_llama_config_is_refused(tmp_path):
    from models.sources.checkpoint import load_checkpoint

    folder = _write_folder(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, {})
    with pytest.raises(UserFacingError, match="GPT2LMHeadModel"):
        load_checkpoint(str(folder))


def test_pickle_only_folder_is_refused_without_opt_in(tiny_llama_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file

    from models.sources.checkpoint import load_checkpoint

    folder = tmp_path / "pickle"
    shutil.copytree(tiny_llama_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), folder / "pytorch_model.bin")
    with pytest.raises(UserFacingError, match="allow-pickle"):
        load_checkpoint(str(folder))
    ckpt = load_checkpoint(str(folder), allow_pickle=True)
    assert "model.embed_tokens.weight" in ckpt.state_dict


def test_corrupt_safetensors_is_refused_and_cli_writes_nothing(tiny_llama_dir, tmp_path):
    import shutil

    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    result = run_cli("run", "--model", str(folder), "--recipe", "xnnpack-fp32", "--out", str(out))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "corrupt or truncated" in last and "model.safetensors" in last
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.builtin
def test_builtin_model_8da4w_end_to_end(builtin_8da4w_run):
    out, report, _shown = builtin_8da4w_run
    assert (out / "model.pte").stat().st_size == report["pte"]["bytes"]
    assert report["model"]["source"] == "builtin"
    assert report["model"]["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    runtime = [g for g in report["generations"] if g["engine"] == "executorch-runtime"]
    assert len(runtime) == 1
    assert "Paris" in runtime[0]["text"], runtime[0]["text"]
    assert runtime[0]["decode_tokens_per_s"] > 0
    linear = {o["op"]: o for o in report["delegation"]["ops"]}["aten_linear_default"]
    # 5 projections (q/k/v fused), 1 rope rotation and 2 norms per layer, plus the final norm and lm_head;
    # one XNNPACK partition per layer
    assert linear["non_delegated"] == 0 and linear["delegated"] == 30 * (5 + 1 + 2) + 1 + 1
    assert report["delegation"]["delegated_subgraphs"] == 30 + 1


@pytest.fixture
def tiny_disk(tmp_path):
    """A 200 kB tmpfs: too small for the tiny model's fp32 .pte (~350 kB)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", str(mount)])


def test_disk_full_while_writing_pte_leaves_nothing_partial(tiny_llama_dir, tiny_disk):
    out = tiny_disk / "out"
    result = run_cli("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out),
                     "--max-seq-len", "64", "--max-new-tokens", "4")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: could not write") and "No space left" in last
    assert not (out / "model.pte").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".partial")]


def test_a_consumed_program_lets_go_of_its_weights_before_serializing_and_gives_the_same_pte(tiny_checkpoint):
    """consume_program: once lowered, the program and its delegated partitions drop their weights, so a weight
    the caller no longer holds is freed before the .pte is written, and the .pte is byte for byte the same."""
    import gc
    import weakref

    from models.llama import build_exportable
    from recipes.lowering.lower import Lowering, export_program, lower_for_backend
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-fp32")
    options = recipe.export_options(64)
    ptes, alive = [], []
    for consume in (False, True):
        module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, options)
        program = export_program(module, options.max_seq_len, strict=recipe.backend.strict_export)
        weight = weakref.ref(module.model.layers[0].mlp.down_proj.weight)
        del module
        ptes.append(lower_for_backend(program, recipe, {}, Lowering(consume_program=consume)).pte)
        gc.collect()
        alive.append(weight() is not None)
        del program
    assert alive == [True, False]
    assert ptes[0] == ptes[1]
