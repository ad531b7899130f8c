"""report.json as typed sections (recipes/output/report.py): files written before the report was typed load and write back
unchanged, a job's report round-trips, the file is the report's one serialization, and the job's summary crosses
a process boundary as plain data."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.output.report import (DelegatedOp, Fidelity, Generation, JobEstimate, JobSummary, LayerError, LayerMap,
                                   OpRow, Quantization, RecipeEstimate, Report, RunnerGeneration, StageError,
                                   TimeEstimate, load_report)

DATA = Path(__file__).resolve().parent / "data"
OLD_REPORTS = sorted(DATA.glob("report_*.json"))


@pytest.mark.parametrize("path", OLD_REPORTS, ids=lambda path: path.stem)
def test_a_report_written_before_the_typed_report_loads_and_writes_back_unchanged(path):
    written = json.loads(path.read_text())
    report = load_report(path)
    assert report.to_dict() == written
    assert report.to_json() == json.dumps(written, indent=2)  # same keys in the same order
    assert Report.from_dict(written, strict=True) == report  # every key has a field


def test_old_reports_are_read_into_typed_sections():
    fp32 = load_report(DATA / "report_xnnpack_fp32.json")
    assert fp32.recipe.name == "xnnpack-fp32" and fp32.timings.export > 0 and fp32.timings.quant_algorithm is None
    assert fp32.fidelity.heldout.top1_agreement_percent == 100.0 and fp32.fidelity.layers is None
    assert [type(g) for g in fp32.generations] == [Generation, Generation] and fp32.profile is None
    assert fp32.memory.estimate.eval_tokens and fp32.llm_metadata.get_eos_ids == [2]
    assert fp32.delegation.ops[0] == DelegatedOp("getitem", 0, 16, before_partitioning=10)
    assert fp32.memory.estimate.recipe_row("xnnpack-fp32") == fp32.memory.estimate.recipes[0]
    assert isinstance(fp32.memory.estimate.recipes[0], RecipeEstimate) and fp32.memory.estimate.recipes[0].stages

    mixed = load_report(DATA / "report_xnnpack_8da4w_mixed_profiled.json")
    assert mixed.quantization.calibration.tokens == 512 and mixed.quantization.mixed_precision.units_8bit
    assert mixed.fidelity.layers.engine == "executorch-runtime" and mixed.fidelity.layers.error is None
    assert isinstance(mixed.profile.decode.ops[0], OpRow) and mixed.profile.files.etrecord == "etrecord.bin"
    assert mixed.fidelity.layers.layers[:2] == [LayerError(0, 22.21, 0.07756), LayerError(1, 19.17, 0.11)]

    qnn = load_report(DATA / "report_qnn_8a8w_layer_map_error.json")
    assert qnn.fidelity.perplexity > 0 and qnn.fidelity.layers.error.stage == "layer_map"
    assert qnn.fidelity.layers.error.traceback and qnn.timings.calibration.prompts > 0
    assert qnn.runtime_note and qnn.pte.bytes > 0

    export_only = load_report(DATA / "report_vulkan_export_only.json")
    assert export_only.generations == [] and export_only.fidelity is None
    assert "export only" in export_only.generation_note and export_only.runner_note is None


def test_a_key_the_report_does_not_know_is_skipped_on_reading_and_refused_from_the_pipeline():
    section = {"scheme": "8da4w", "algorithm": "awq", "weight_bytes_per_token": 10, "new_figure": 1}
    assert Quantization.from_dict(section) == Quantization("8da4w", "awq", weight_bytes_per_token=10)
    with pytest.raises(ValueError, match="new_figure"):
        Quantization.from_dict(section, strict=True)
    # timings keep the seconds of parts they do not name, as they are
    report = Report.from_dict({"timings_s": {"export": 1.0, "new_part": 2.0}})
    assert report.timings.export == 1.0 and report.to_dict()["timings_s"] == {"export": 1.0, "new_part": 2.0}


def test_the_jobs_estimate_keeps_its_recipes_times_for_their_own_reports_and_writes_them_rounded():
    """memory.estimate holds the job's memory and disk; each recipe's seconds, kept exact for the app's sums, go to
    that recipe's report under timings_s.estimate, rounded as report.json writes them."""
    time = TimeEstimate(export=12.345, lower=3.06, other=20.0, total=40.051, fitted_on="134M–3.2B", shared=4.649,
                        rates_from="Some CPU, 2 cores", host_speed=0.8749)
    estimate = JobEstimate(peak_rss_bytes=10, disk_bytes=2, checkpoint_bytes=4, stages={"load": 5},
                           recipes=[RecipeEstimate("xnnpack-fp32", 10, {"lower": 10}, 2, time=time)],
                           peak_stage="xnnpack-fp32 lower", time_notes=["a 27K model is outside the cells"])
    written = estimate.to_dict()
    assert written == {"peak_rss_bytes": 10, "disk_bytes": 2, "checkpoint_bytes": 4, "reference_dtype": None,
                       "stages": {"load": 5}, "recipes": [{"recipe": "xnnpack-fp32", "peak_rss_bytes": 10,
                                                           "stages": {"lower": 10}, "pte_bytes": 2}],
                       "reference_weight_dtype": None, "eval_tokens": None, "peak_stage": "xnnpack-fp32 lower"}
    assert JobEstimate.from_dict(written, strict=True) == estimate  # its times are no keys of memory.estimate
    assert estimate.seconds == time.total
    recorded = estimate.recipe_time("xnnpack-fp32")
    assert recorded.to_dict() == time.to_dict() == {
        "export": 12.3, "lower": 3.1, "other": 20.0, "total": 40.1, "fitted_on": "134M–3.2B", "shared": 4.6,
        "rates_from": "Some CPU, 2 cores", "host_speed": 0.87}
    report = Report()
    report.timings.estimate = recorded
    assert Report.from_dict(json.loads(report.to_json()), strict=True) == report


def test_a_failed_measurement_is_its_error_alone():
    failed = Fidelity(error=StageError("fidelity", "ValueError: no logits", "Traceback ..."))
    assert failed.to_dict() == {"error": {"stage": "fidelity", "message": "ValueError: no logits",
                                          "traceback": "Traceback ..."}}
    assert Fidelity.from_dict(failed.to_dict()) == failed
    no_map = LayerMap(error=StageError("layer_map", "the graph has no decoder layers"))
    assert no_map.to_dict() == {"error": {"stage": "layer_map", "message": "the graph has no decoder layers"}}


def test_a_jobs_report_round_trips_and_is_the_file_on_disk(runner_llama_run):
    folder, report = runner_llama_run
    assert isinstance(report.generations[1], RunnerGeneration) and report.profile is not None
    assert Report.from_dict(report.to_dict()) == report
    written = json.loads((folder / "report.json").read_text())
    assert written == report.to_dict()
    assert Report.from_dict(written, strict=True) == report


def test_the_summary_unpickles_where_torch_is_not_loaded(runner_llama_run, tmp_path):
    """The app gets the summary from the job's process through a queue: plain data, read without torch."""
    _folder, report = runner_llama_run
    summary = JobSummary(report.model, report.generations[0], [report])
    path = tmp_path / "summary.pickle"
    path.write_bytes(pickle.dumps(summary))
    assert pickle.loads(path.read_bytes()) == summary
    code = ("import pickle, sys; summary = pickle.load(open(sys.argv[1], 'rb')); "
            "print(summary.recipes[0].recipe.name, 'torch' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    shown = subprocess.run([sys.executable, "-c", code, str(path)], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    assert shown == ["xnnpack-fp32", "False"]
