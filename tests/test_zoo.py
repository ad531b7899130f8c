"""The zoo's data: every entry is a config of a family the pipeline loads, and every recommendation fits it."""
import json
import math
from pathlib import Path

import pytest

from zoo.entries import load_entries, recommendation_problems

ENTRIES = load_entries()
REQUIRED = ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct",
            "HuggingFaceTB/SmolLM2-1.7B-Instruct", "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
            "meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")


def test_zoo_lists_the_required_models():
    assert set(REQUIRED) <= set(ENTRIES)


@pytest.mark.parametrize("repo_id", sorted(ENTRIES))
def test_zoo_entry_config_loads_as_its_familys_config(repo_id, tmp_path):
    """The entry's config as a checkpoint's config.json, read as the pipeline reads one: transformers picks the
    config class by model_type, which must be one its family (named by its architectures) takes; and the shape the
    zoo's estimates read from it is the one a job builds."""
    from models.families import family_named, module_shape
    from models.sources.config import read_config
    from models.llama import checkpoint_tensors

    entry = ENTRIES[repo_id]
    (tmp_path / "config.json").write_text(json.dumps(entry.config))
    loaded = read_config(tmp_path)  # raises on a config of no family's or whose sizes do not fit together
    config = entry.model_config()
    family = family_named(loaded)
    assert family is not None and loaded.model_type in family.model_types, (family, loaded.model_type)
    assert type(loaded) is type(config), type(loaded).__name__
    assert module_shape(config) == module_shape(loaded)
    # the module's tensors hold the entry's published parameter count (embeddings counted once when tied)
    counted = sum(math.prod(size) for name, size in checkpoint_tensors(config).items()
                  if not (config.tie_word_embeddings and name == "lm_head.weight"))
    published = json.loads(Path(entry.path).read_text())["parameters"]  # as its model card rounds it: "1.24B"
    assert counted == pytest.approx(float(published[:-1]) * {"M": 1e6, "B": 1e9}[published[-1]], rel=0.01), published


@pytest.mark.parametrize("repo_id", sorted(ENTRIES))
def test_zoo_entry_recommendations_exist_and_fit_the_shape(repo_id):
    entry = ENTRIES[repo_id]
    assert {"xnnpack", "coreml"} <= set(entry.recommended)
    assert recommendation_problems(entry) == []
    for rec in entry.recommended.values():
        assert rec["why"] and rec["quant_algorithm"]


def test_zoo_gated_entries_name_an_ungated_mirror():
    for entry in ENTRIES.values():
        assert entry.license
        if entry.gated:
            assert entry.ungated_mirror and entry.ungated_mirror != entry.repo_id


def test_zoo_recommendation_check_refuses_a_group_that_does_not_divide():
    import dataclasses

    entry = ENTRIES["HuggingFaceTB/SmolLM2-135M-Instruct"]
    xnn = {**entry.recommended["xnnpack"], "options": {"group_size": 128}, "max_seq_len": 10**6}
    bad = dataclasses.replace(entry, recommended={"xnnpack": xnn})
    problems = recommendation_problems(bad)
    assert any("does not divide" in p and "576" in p for p in problems)
    assert any("max context" in p for p in problems)


def test_builtin_zoo_entry_matches_the_builtin_checkpoint_config():
    from models.sources.checkpoint import builtin_gguf_path, load_checkpoint

    if builtin_gguf_path() is None:
        pytest.skip("the built-in GGUF is not installed")
    entry = ENTRIES["HuggingFaceTB/SmolLM2-135M-Instruct"]
    config = load_checkpoint(None).config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, key) == pytest.approx(entry.config[key]), key
    assert config.rope_parameters["rope_theta"] == entry.model_config().rope_parameters["rope_theta"]


def test_matrix_cli_refuses_an_unknown_model_or_recipe_before_starting_ray(tmp_path):
    import sys

    from tests.conftest import run_main

    unknown_model = run_main("matrix", "--models", "nobody/none", "--recipes", "xnnpack-fp32", "--out", str(tmp_path))
    assert unknown_model.returncode == 2 and "is not in the zoo" in unknown_model.stderr
    unknown_recipe = run_main("matrix", "--models", "smollm2-360m-instruct", "--recipes", "xnnpack-int3",
                              "--weights", "random", "--out", str(tmp_path))
    assert unknown_recipe.returncode == 2 and "xnnpack" in unknown_recipe.stderr
    assert not (tmp_path / "results.json").exists()
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()


def test_zoo_table_shows_a_full_job_over_an_export_only_run_of_the_same_cell():
    from zoo.cell_result import CellResult, JobFigures
    from zoo.report import backend_tables

    def cell(export_only, status="ok", decode=None):
        return CellResult(model="m", recipe="xnnpack-8da4w", backend="xnnpack", status=status, export_only=export_only,
                          figures=JobFigures(delegated_percent=80.0, pte_mb=900.0, export_s=10.0, peak_rss_mb=4096.0,
                                             decode_tokens_per_s=decode, engine="executorch-runtime",
                                             fidelity="needs real weights"))

    for cells in ([cell(False, decode=20.4), cell(True)], [cell(True), cell(False, decode=20.4)]):
        table = "\n".join(backend_tables(cells))
        assert "20.4 tok/s (executorch-runtime)" in table and "4.00 GiB" in table and "export only" not in table
    failed_full = "\n".join(backend_tables([cell(False, status="failed"), cell(True)]))
    assert "export only" in failed_full and "failed" not in failed_full


def test_zoo_table_sizes_a_cell_by_its_pte_and_ptd_and_times_it_by_its_whole_job():
    from zoo.cell_result import CellResult, JobFigures
    from zoo.entries import table_rows
    from zoo.report import backend_tables

    cell = CellResult(model="m", recipe="xnnpack-8da4w", backend="xnnpack", status="ok", export_only=True, seconds=562.0,
                      figures=JobFigures(delegated_percent=83.0, pte_mb=527.2, ptd_mb=4000.5, export_s=8.6,
                                         peak_rss_mb=9000.0, fidelity="needs real weights"))
    table = "\n".join(backend_tables([cell]))
    assert "4527.7 MB / 562.0 s" in table and "8.6 s" not in table
    (row,) = table_rows([cell])
    assert row["files MB"] == 4527.7 and row["job s"] == 562.0
    assert CellResult.from_dict(cell.to_dict()).measured.ptd_mb == 4000.5


def test_zoo_table_shows_the_cell_measured_on_the_newest_executorch():
    from zoo.cell_result import CellResult, JobFigures
    from zoo.report import backend_tables

    def cell(executorch, peak_mb):
        return CellResult(model="m", recipe="xnnpack-8da4w", backend="xnnpack", status="ok", export_only=True,
                          versions={"executorch": executorch},
                          figures=JobFigures(delegated_percent=80.0, pte_mb=900.0, export_s=10.0, peak_rss_mb=peak_mb,
                                             fidelity="needs real weights"))

    for cells in ([cell("1.4.1", 4096.0), cell("1.5.1", 3072.0)], [cell("1.5.1", 3072.0), cell("1.4.1", 4096.0)]):
        table = "\n".join(backend_tables(cells))
        assert "3.00 GiB" in table and "4.00 GiB" not in table


def test_zoo_scaling_plot_has_a_line_per_recipe_on_enough_models_with_the_shown_cells(tmp_path):
    from dataclasses import replace

    from zoo.cell_result import CellResult, JobFigures
    from zoo.plots import scaling_series

    def cell(model, recipe, peak_mb, executorch="1.5.1", export_only=True, status="ok"):
        return CellResult(model=model, recipe=recipe, status=status, export_only=export_only,
                          versions={"executorch": executorch},
                          figures=JobFigures(peak_rss_mb=peak_mb, pte_mb=peak_mb and peak_mb / 4))

    params = {"small": 1e8, "mid": 1e9, "big": 3e9}
    cells = [cell("big", "xnnpack-8da4w", 6144.0), cell("small", "xnnpack-8da4w", 1024.0),
             cell("mid", "xnnpack-8da4w", 4096.0, executorch="1.4.1"), cell("mid", "xnnpack-8da4w", 3072.0),
             cell("mid", "xnnpack-8da4w", 9999.0, export_only=False),  # a full job: not an export-only cost
             cell("small", "coreml-int4", 2048.0), cell("mid", "coreml-int4", 8192.0),
             cell("big", "coreml-int4", None, status="refused"),  # two finished models: no line
             cell("unlisted", "xnnpack-8da4w", 512.0),  # no size known: left out, not an error
             replace(cell("own-entry", "xnnpack-8da4w", 2048.0), params=5e8)]  # the cell's own count
    series = scaling_series(cells, params.get)

    assert list(series) == ["xnnpack-8da4w"]
    assert [(p["model"], p["peak_gib"]) for p in series["xnnpack-8da4w"]] == [
        ("small", 1.0), ("own-entry", 2.0), ("mid", 3.0), ("big", 6.0)]
    # Rendered in a fresh interpreter, as the matrix's own driver process renders it: matplotlib's FreeType
    # module has crashed on import in a test worker that had loaded other native libraries before it.
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = ("import json, sys; from pathlib import Path; from zoo.plots import write_scaling_plot; "
              "write_scaling_plot(json.loads(sys.argv[1]), Path(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", script, json.dumps(series), str(tmp_path / "scaling.png")], check=True,
                   cwd=Path(__file__).resolve().parent.parent)
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_results_json_reads_into_typed_cells_and_writes_back_byte_for_byte():
    """zoo/results.json as the matrix wrote it, with cells of the versions that wrote it (some without the keys
    added since): read into CellResults, then written as the matrix writes results.json and each cell's file."""
    from zoo.cell_result import load_results
    from zoo.entries import ZOO_DIR

    path = ZOO_DIR / "results.json"
    results = load_results(path)
    assert results.to_json().encode() == path.read_bytes()
    stored = json.loads(path.read_text())["cells"]
    assert [cell.to_json() for cell in results.cells] == [json.dumps(cell, indent=2) for cell in stored]
    for cell in results.cells:
        assert cell.status in ("ok", "failed", "refused", "oom") and cell.model and cell.recipe
        if cell.status == "ok":
            assert cell.figures is not None and cell.measured.peak_rss_mb > 0 and cell.estimate_gib is None
        if cell.status == "refused":
            assert cell.figures is None and cell.task is None and cell.estimate_gib > 0
            assert cell.measured.pte_mb is None  # a cell without figures reads as measuring nothing


# Records as earlier versions of the matrix wrote them: before the parameter count, the time of day, the memory
# limit, the host's speed and the stage times were recorded, and with a key this version does not know.
OLDER_CELLS = [
    {"key": "a" * 16, "model": "m/a", "recipe": "xnnpack-8da4w", "backend": "xnnpack", "options": {"group_size": 128},
     "max_seq_len": 512, "export_only": True, "weights": "random bf16, shape-identical",
     "model_identity": "config-sha256:0", "versions": {"executorch": "1.4.1"}, "date": "2026-11-30",
     "cpu": "AMD EPYC", "cores": 2, "host": "vm", "status": "failed", "stage": "request",
     "reason": "group size 128 does not divide q/k/v/gate/up/lm_head (576)", "seconds": 1.5},
    {"key": "b" * 16, "model": "m/b", "recipe": "coreml-fp16", "backend": "coreml", "options": {},
     "max_seq_len": 512, "export_only": True, "weights": "random bf16, shape-identical",
     "model_identity": "config-sha256:1", "versions": {"executorch": "1.5.1"}, "date": "2026-12-01",
     "cpu": "AMD EPYC", "cores": 2, "status": "refused", "stage": "memory-estimate",
     "reason": "needs ~24.0 GiB", "estimate_gib": 24.01},
    {"key": "c" * 16, "model": "m/c", "recipe": "xnnpack-fp32", "backend": "xnnpack", "params": 134515008,
     "options": {}, "max_seq_len": 256, "export_only": False, "weights": "hub", "model_identity": "hub:0",
     "versions": {"executorch": "1.5.1"}, "date": "2026-12-02", "measured_at": "2026-12-02T10:00:00Z",
     "cpu": "AMD EPYC", "cores": 2, "host": "vm", "memory_limit_bytes": 17179869184.0, "status": "ok",
     "stage": None, "reason": None, "delegated_percent": 99.5, "pte_mb": 540.2, "export_s": 20.0, "lower_s": 30.0,
     "peak_rss_mb": 2048.0, "decode_tokens_per_s": 12.5, "engine": "executorch-llm-runner", "perplexity_ratio": 1.0,
     "fidelity": "measured", "runtime_note": None, "quant_algorithm": None, "seconds": 120.0,
     "written_by_a_later_version": [1, 2]},
    {"key": "d" * 16, "model": "m/d", "recipe": "xnnpack-fp32", "backend": "xnnpack", "options": {},
     "max_seq_len": 512, "export_only": True, "weights": "random bf16, shape-identical",
     "model_identity": "config-sha256:3", "versions": {"executorch": "1.5.1"}, "date": "2026-12-03",
     "measured_at": None, "cpu": "AMD EPYC", "cores": 2, "status": "oom", "stage": "run",
     "reason": "out of memory: OutOfMemoryError: killed"},
]


def test_cells_written_by_earlier_versions_load_and_keep_their_keys():
    from zoo.cell_result import CellResult

    failed, refused, full_job, killed = cells = [CellResult.from_dict(record) for record in OLDER_CELLS]
    assert [cell.to_json() for cell in cells] == [json.dumps(record, indent=2) for record in OLDER_CELLS]
    assert (failed.status, failed.stage, failed.params, failed.task.host, failed.task.host_speed) == (
        "failed", "request", None, "vm", None)
    assert failed.figures is None and failed.seconds == 1.5 and failed.executorch_version == (1, 4, 1)
    assert (refused.estimate_gib, refused.task, refused.measured.peak_rss_mb) == (24.01, None, None)
    # a key written as null stays, one never written stays away
    assert full_job.measured.quant_algorithm is None and "quant_algorithm" in full_job.to_dict()
    assert full_job.measured.stages_s is None and "stages_s" not in full_job.to_dict()
    assert full_job.other == {"written_by_a_later_version": [1, 2]} and full_job.measured.decode_tokens_per_s == 12.5
    assert killed.measured_at is None and "measured_at" in killed.to_dict() and "host" not in killed.to_dict()


def test_a_new_cell_writes_every_key_of_its_kind_in_the_matrixs_order():
    from zoo.cell_result import CellResult, JobFigures, TaskHost

    ran = CellResult(key="k", model="m", status="ok", task=TaskHost(host="vm"), figures=JobFigures(alone=True),
                     seconds=3.0)
    keys = list(ran.to_dict())
    assert keys[:2] == ["key", "model"] and keys[-1] == "seconds" and "estimate_gib" not in keys
    assert keys.index("cores") < keys.index("host") < keys.index("host_speed") < keys.index("status")
    assert keys.index("reason") < keys.index("delegated_percent") and keys.index("quant_algorithm") < keys.index("seconds")
    assert ran.to_dict()["memory_limit_bytes"] is None and ran.to_dict()["stage"] is None
    refused = CellResult(key="k", status="refused", estimate_gib=30.0)
    assert list(refused.to_dict())[-1] == "estimate_gib" and "seconds" not in refused.to_dict()
    assert "host" not in refused.to_dict() and "pte_mb" not in refused.to_dict()
