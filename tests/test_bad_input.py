"""Bad input gets one clear line that says what to do, a non-zero exit, and nothing written."""
import pytest

from tests.conftest import run_cli, run_main


def _fails_cleanly(result, out, *fragments):
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), last
    for fragment in fragments:
        assert fragment in last, last
    assert "Traceback" not in result.stderr
    assert not out.exists() or not list(out.rglob("model.pte"))
    return last


@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory):
    """A real (tiny) GGUF file of another architecture."""
    import gguf
    import numpy as np

    path = tmp_path_factory.mktemp("gguf") / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_of_another_architecture_is_refused(gpt2_gguf, tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", "--model", str(gpt2_gguf), "--recipe", "xnnpack-fp32", "--out", str(out))
    _fails_cleanly(result, out, "architecture 'gpt2'", "reads GGUF files of llama")


def test_missing_local_path_is_refused(tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", "--model", str(tmp_path / "nowhere"), "--recipe", "xnnpack-fp32", "--out", str(out))
    _fails_cleanly(result, out, "does not exist")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-seq-len", "0"], "max context must be at least 16"),
        (["--max-seq-len", "-5"], "max context must be at least 16"),
        (["--max-seq-len", "100000"], "beyond this model's limit of 2048"),
        (["--max-seq-len", "64", "--max-new-tokens", "64"], "must be smaller than max context"),
        (["--prompt", "   "], "prompt is empty"),
    ],
    ids=["context-0", "context-negative", "context-beyond-model", "new-tokens-beyond-context", "empty-prompt"],
)
def test_bad_recipe_input_is_refused(tiny_llama_dir, tmp_path, args, message):
    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out), *args)
    _fails_cleanly(result, out, message)


def test_prompt_longer_than_the_context_is_refused_before_any_export(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out),
                     "--max-seq-len", "64", "--prompt", "hello world " * 5000)
    _fails_cleanly(result, out, "does not fit in the max context of 64")
    assert "exporting" not in result.stderr


def test_non_ascii_and_emoji_prompt_runs(tiny_llama_dir, tmp_path):
    import json

    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(out),
                      "--max-seq-len", "64", "--max-new-tokens", "4", "--prompt", "Grüß Gott, 東京 🚀🙂 ?")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["generations"][0]["prompt"] == "Grüß Gott, 東京 🚀🙂 ?"
    assert [g["engine"] for g in report["generations"]] == ["eager-fp32", "executorch-runtime"]


def _job(root, name, size, age_s):
    import os
    import time

    job = root / name
    job.mkdir(parents=True)
    (job / "model.pte").write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(job, (stamp, stamp))
    return job


def test_old_jobs_are_removed_and_the_jobs_folder_is_capped(tmp_path):
    from models.errors import UserFacingError
    from ui import jobs

    root = tmp_path / "jobs"
    stale = _job(root, "stale", 10, age_s=7 * 3600)
    oldest = _job(root, "oldest", 400, age_s=300)
    running = _job(root, "running", 400, age_s=200)
    newest = _job(root, "newest", 400, age_s=100)
    jobs.clean_old_jobs(root, max_age_s=6 * 3600)
    assert not stale.exists() and oldest.exists()

    jobs.ACTIVE_JOBS.add(running)
    try:
        jobs.enforce_disk_cap(root, max_bytes=900)  # 1200 bytes: the oldest finished job goes first
        assert not oldest.exists() and running.exists() and newest.exists()
        with pytest.raises(UserFacingError, match="running jobs use"):
            jobs.enforce_disk_cap(root, max_bytes=300)  # only the running job is left, still over the cap
        assert running.exists() and not newest.exists()
    finally:
        jobs.ACTIVE_JOBS.discard(running)


def test_a_job_folder_is_kept_when_its_job_finishes_and_removed_when_it_fails(tmp_path, monkeypatch):
    from models.errors import UserFacingError
    from ui import jobs

    monkeypatch.setenv("LOWERBENCH_JOBS_DIR", str(tmp_path / "jobs"))
    with jobs.job_folder() as kept:
        assert kept in jobs.ACTIVE_JOBS and kept.parent == tmp_path / "jobs"
        (kept / "report.json").write_text("{}")
    assert (kept / "report.json").is_file() and kept not in jobs.ACTIVE_JOBS
    with pytest.raises(UserFacingError, match="no recipe"):
        with jobs.job_folder() as failed:
            (failed / "model.pte").write_bytes(b"partial")
            raise UserFacingError("no recipe chosen")
    assert not failed.exists() and failed not in jobs.ACTIVE_JOBS


@pytest.mark.parametrize("stage", ["quantizing", "exporting", "lowering"])
def test_cancel_during_a_stage_stops_the_job_promptly(tiny_llama_dir, tmp_path, stage):
    """The app's job runner: Cancel pressed while `stage` runs ends the job within seconds (the job's process
    is killed if the stage does not finish), and no .pte or report is left."""
    import threading
    import time

    from models.errors import UserFacingError
    from ui import jobs
    from recipes.request import RunRequest

    session = f"cancel-{stage}"
    cancelled_at = []

    def progress(fraction, message):
        if message.startswith(stage) and not cancelled_at:
            cancelled_at.append(time.monotonic())
            threading.Thread(target=jobs.cancel_job, args=(session,)).start()

    request = RunRequest(recipes=["xnnpack-8da4w"], out_dir=tmp_path / "job", model=str(tiny_llama_dir),
                         max_seq_len=64, max_new_tokens=4, prompt="what is the capital ?")
    with pytest.raises(UserFacingError, match="cancelled"):
        jobs.run_job(request, session, progress)
    assert cancelled_at, f"the job never reached {stage}"
    assert time.monotonic() - cancelled_at[0] < jobs.CANCEL_GRACE_S + 10
    assert not list((tmp_path / "job").rglob("model.pte")) and not list((tmp_path / "job").rglob("report.json"))


def test_export_only_job_has_no_prompt_to_fit_in_its_context(tiny_checkpoint, tmp_path):
    from models.errors import UserFacingError
    from recipes.request import RunRequest, check_prompt_fits

    long_prompt = "hello world " * 100
    check_prompt_fits(tiny_checkpoint, RunRequest(recipes=["xnnpack-fp32"], out_dir=tmp_path, prompt=long_prompt,
                                                  max_seq_len=32, generate=False))
    with pytest.raises(UserFacingError, match="does not fit in the max context of 32"):
        check_prompt_fits(tiny_checkpoint, RunRequest(recipes=["xnnpack-fp32"], out_dir=tmp_path, prompt=long_prompt,
                                                      max_seq_len=32))


def _edit_config(folder, **fields):
    import json

    config = json.loads((folder / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _shorter_vocabulary(folder):
    """A model of 10 tokens whose tokenizer has more: every tensor agrees with the config, the tokenizer does not."""
    _edit_config(folder, vocab_size=10)
    _edit_tensors(folder, lambda t: t.update({name: t[name][:10].clone()
                                               for name in ("model.embed_tokens.weight", "lm_head.weight")}))


def _two_shards_one_missing(folder):
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    first = {name: tensors[name] for name in names[: len(names) // 2]}
    save_file(first, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {name: "model-00001-of-00002.safetensors" if name in first else "model-00002-of-00002.safetensors"
                  for name in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _a_tensor_in_two_shards(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, folder / "extra.safetensors",
              metadata={"format": "pt"})


# How a checkpoint folder can disagree with itself, and what the one line names. The tiny Llama: 2 layers,
# hidden 64, 4 heads of 16, 2 key/value heads, 18 tokens, a separate output layer.
def _replace_tensor(name: str, make):
    return lambda folder: _edit_tensors(folder, lambda tensors: tensors.update({name: make(tensors)}))


def _q_proj_rows(tensors):
    return tensors["model.layers.0.self_attn.q_proj.weight"][:32].clone()


def _up_proj_as_int8(tensors):
    import torch

    return tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int8)


INCONSISTENT = {
    "heads-not-dividing-hidden": (lambda f: _edit_config(f, num_attention_heads=5, head_dim=None),
                                  "hidden size (64) is not a multiple of the number of attention heads (5)"),
    "kv-heads-not-dividing-heads": (lambda f: _edit_config(f, num_key_value_heads=3),
                                    "not a multiple of num_key_value_heads (3)"),
    "odd-head-size": (lambda f: _edit_config(f, head_dim=15), "RoPE requires an even rotary dimension"),
    "a-size-of-zero": (lambda f: _edit_config(f, num_hidden_layers=0), "num_hidden_layers is 0"),
    "a-size-as-text": (lambda f: _edit_config(f, hidden_size="64"), "'hidden_size' expected int"),
    "no-hidden-size": (lambda f: _edit_config(f, hidden_size=None),
                       "model.embed_tokens.weight is [18, 64], config.json's sizes make it [18, 4096]"),
    "norm-epsilon-zero": (lambda f: _edit_config(f, rms_norm_eps=0.0), "rms_norm_eps is 0.0; it must be a positive"),
    "another-activation": (lambda f: _edit_config(f, hidden_act="gelu"), "hidden_act is 'gelu'"),
    "unknown-rope": (lambda f: _edit_config(f, rope_parameters={"rope_type": "nonsense", "rope_theta": 10000.0}),
                     "rotary embedding settings cannot be built"),
    "more-layers-in-config": (lambda f: _edit_config(f, num_hidden_layers=3), "tensors of 2 decoder layers"),
    "fewer-layers-in-config": (lambda f: _edit_config(f, num_hidden_layers=1), "tensors of 2 decoder layers"),
    "missing-tensor": (lambda f: _edit_tensors(f, lambda t: t.pop("model.layers.1.mlp.down_proj.weight")),
                       "has no tensor model.layers.1.mlp.down_proj.weight"),
    "unexpected-tensor": (_replace_tensor("model.layers.0.self_attn.q_proj.bias",
                                          lambda t: t["model.norm.weight"].clone()),
                          "has a tensor model.layers.0.self_attn.q_proj.bias"),
    "wrong-shape": (_replace_tensor("model.layers.0.self_attn.q_proj.weight", _q_proj_rows),
                    "model.layers.0.self_attn.q_proj.weight is [32, 64], config.json's sizes make it [64, 64]"),
    "integer-tensor": (_replace_tensor("model.layers.0.mlp.up_proj.weight", _up_proj_as_int8),
                       "model.layers.0.mlp.up_proj.weight is stored as I8"),
    "untied-without-output-layer": (lambda f: _edit_tensors(f, lambda t: t.pop("lm_head.weight")),
                                    "has no lm_head.weight"),
    "tied-to-a-different-output-layer": (lambda f: _edit_config(f, tie_word_embeddings=True),
                                         "lm_head.weight differs from model.embed_tokens.weight"),
    "tokenizer-beyond-vocabulary": (_shorter_vocabulary,
                                    "the tokenizer has token id 17, but config.json's vocab_size is 10"),
    "stop-id-beyond-vocabulary": (lambda f: _edit_config(f, eos_token_id=5000),
                                  "eos_token_id 5000 is outside the vocabulary"),
    "missing-shard": (_two_shards_one_missing, "lacks model-00002-of-00002.safetensors"),
    "tensor-in-two-files": (_a_tensor_in_two_shards, "model.norm.weight is in both"),
    "config-not-an-object": (lambda f: (f / "config.json").write_text("[1, 2]"), "holds a JSON list"),
}


@pytest.mark.parametrize("case", INCONSISTENT)
def test_a_checkpoint_that_disagrees_with_itself_is_refused_in_one_line(tiny_llama_dir, tmp_path, case):
    import shutil

    edit, message = INCONSISTENT[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    edit(folder)
    out = tmp_path / "out"
    result = run_main("run", "--model", str(folder), "--recipe", "xnnpack-fp32", "--out", str(out),
                      "--max-seq-len", "64", "--max-new-tokens", "4")
    _fails_cleanly(result, out, message)
    assert not out.exists() or not any(out.iterdir())


def test_a_kv_window_that_never_wraps_is_refused_before_any_weight_is_read(tiny_llama_dir, tmp_path, monkeypatch):
    """The tiny Llama's context is 2048 tokens: a ring of 2044 recent tokens and 4 sinks would hold all of it."""
    import models.sources.checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(models.sources.checkpoint, "load_state_dict", no_weights)
    out = tmp_path / "out"
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-8da4w", "--out", str(out),
                      "--kv-cache-window", "2044")
    _fails_cleanly(result, out, "a KV cache window of 2044 tokens (xnnpack-8da4w)", "Choose a window below 2044")
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-8da4w", "--out", str(out),
                      "--max-seq-len", "4096")
    _fails_cleanly(result, out, "max context 4096 is beyond this model's limit of 2048")
