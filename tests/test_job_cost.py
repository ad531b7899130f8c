"""What the Lower page says before the click: the job's memory, disk and time (app.job_cost_text) for a local
folder, for a Hub repo on tests/hub_server.py and for the built-in model, and a refusal with what would fit."""
import re

import pytest

import app
from tests.conftest import GOOD_TOKEN


def cost(source=app.LOCAL, hub_repo="", local_path="", recipes=("xnnpack-8da4w",), max_seq_len=64, export_only=False,
         token="", options=None):
    return app.job_cost_text(app.ModelFields(source, hub_repo, "", local_path, token), list(recipes),
                             options or {"group_size": 32}, max_seq_len, export_only)


def test_a_local_folder_gets_memory_disk_and_time_before_the_click(tiny_llama_dir):
    text = cost(local_path=str(tiny_llama_dir))
    assert re.search(r"Memory: about \d+\.\d GB at its peak \(xnnpack-8da4w \w+\); fits in", text)
    assert re.search(r"Disk: 0\.\d\d MB of \.pte files \(\d+ GB free\)", text) and "download" not in text  # a local folder downloads nothing
    size = r"\d+(\.\d)?[KMB]"
    assert re.search(rf"Time: about \d+ (s|min) .*rates fitted on zoo cells of {size}–{size} measured on .+, \d+ "
                     r"cores? \(.+\), scaled to this host's speed \(\d+\.\d\d× theirs\)", text), text
    assert re.search(rf"outside the {size}–{size} the cells measured: extrapolated", text)  # the tiny Llama is far smaller
    two = cost(local_path=str(tiny_llama_dir), recipes=("xnnpack-8da4w", "xnnpack-fp32"))
    assert "2 recipes" in two and two != text


def test_a_hub_repo_is_estimated_from_its_config_alone(hub):
    text = cost(app.HUB, hub_repo="org/tiny-llama")
    assert "to download into the Hugging Face cache" in text and "Time: about" in text
    assert {path.rsplit("/", 1)[-1] for _, path, _ in hub.log if "/resolve/" in path} == {"config.json"}
    gated = cost(app.HUB, hub_repo="org/gated-llama")
    assert "No estimate yet" in gated and "is gated" in gated
    assert "Time: about" in cost(app.HUB, hub_repo="org/gated-llama", token=GOOD_TOKEN)


def test_a_job_that_would_be_refused_says_so_with_what_would_fit(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("LOWERBENCH_MEMORY_LIMIT_GB", "0.4")
    text = cost(local_path=str(tiny_llama_dir), recipes=("xnnpack-8da4w", "xnnpack-fp32"))
    assert "**This job would be refused**: this job needs about" in text
    assert "the limit of 0.4 GB (LOWERBENCH_MEMORY_LIMIT_GB)" in text
    assert "--export-only" in text and "one recipe at a time" in text


def test_what_the_job_would_refuse_is_named_instead_of_an_estimate(tiny_llama_dir):
    assert cost(local_path=str(tiny_llama_dir / "missing")).startswith("**No estimate yet**: local path")
    assert "is not offered for 8da4w" in cost(local_path=str(tiny_llama_dir), options={"quant_algorithm": "nope"})
    assert cost(local_path=str(tiny_llama_dir), recipes=()) == "Tick at least one recipe to see what the job will cost."


@pytest.mark.parametrize("export_only", [False, True])
def test_the_builtin_model_is_estimated_offline(export_only):
    text = cost(app.BUILTIN, export_only=export_only, max_seq_len=512)
    assert "134M parameters" in text and "Time: about" in text
    assert ("export-only job" in text) == export_only
