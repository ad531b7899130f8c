"""The summary a person reads: labelled figures with units, no raw values, a decision chart, the zip of a folder."""
import json
import math
import zipfile
from pathlib import Path

from recipes.output.report import JobSummary, load_report
from recipes.output.summary import COLUMNS, MISSING, decision_chart, summary_rows, text_table

DATA = Path(__file__).resolve().parent / "data"


def _summary(*names: str) -> JobSummary:
    reports = [load_report(DATA / name) for name in names]
    reference = next((r.generations[0] for r in reports if r.generations), None)
    return JobSummary(reports[0].model, reference, reports)


def shows_a_raw_value(cell) -> bool:
    """What a person must never see in a cell: an object, a section of the report, None, NaN."""
    if isinstance(cell, (dict, list, tuple)) or cell is None:
        return True
    if isinstance(cell, float) and not math.isfinite(cell):
        return True
    text = str(cell)
    return any(bad in text for bad in ("[object", "None", "nan", "{"))


def test_every_cell_is_a_figure_or_a_dash_under_a_label_with_its_unit():
    summary = _summary("report_xnnpack_fp32.json", "report_xnnpack_8da4w_mixed_profiled.json",
                       "report_qnn_8a8w_layer_map_error.json", "report_vulkan_export_only.json")
    rows = summary_rows(summary)
    assert [list(row) for row in rows] == [list(COLUMNS)] * 4
    assert {"delegated (% of nodes)", "in delegates (% of decode time)", ".pte (MB)", "weights read per token (MB)",
            "decode (tok/s)", "engine", "perplexity vs fp32 (×)", "held-out (×)", "top-1 agreement (%)",
            "mean KL"} <= set(COLUMNS)
    assert [cell for row in rows for cell in row.values() if shows_a_raw_value(cell)] == []
    fp32, int4, qnn, vulkan = rows
    assert fp32["fidelity target"].endswith(": yes") and fp32["top-1 agreement (%)"] == 100.0
    assert isinstance(int4["in delegates (% of decode time)"], float)
    assert int4["weights read per token (MB)"] < fp32[".pte (MB)"]
    assert vulkan["perplexity vs fp32 (×)"] == MISSING and vulkan["decode (tok/s)"] == MISSING
    json.dumps(rows)  # summary.json takes the same rows
    table = text_table(rows)
    assert table.splitlines()[0].startswith("recipe") and len(table.splitlines()) == 5


def test_the_decision_chart_has_a_point_per_recipe_with_fidelity():
    summary = _summary("report_xnnpack_fp32.json", "report_xnnpack_8da4w_mixed_profiled.json",
                       "report_vulkan_export_only.json")
    chart = decision_chart(summary)
    assert [p["recipe"] for p in chart.points] == ["xnnpack-fp32", "xnnpack-8da4w"]
    assert chart.x_title == "decode (tok/s)"  # both .pte ran on the ExecuTorch runtime
    assert all(p["x"] > 0 and p["perplexity_ratio"] > 0 and p["pte_mb"] > 0 for p in chart.points)
    assert all(p["label"].startswith(f"{p['recipe']} · executorch-") for p in chart.points)
    assert "vulkan-fp32" in chart.note


def test_a_recipe_whose_pte_cannot_run_here_puts_every_point_on_bytes_read_per_token():
    summary = _summary("report_xnnpack_8da4w_mixed_profiled.json", "report_qnn_8a8w_layer_map_error.json")
    chart = decision_chart(summary)
    assert chart.x_title == "weights read per token (MB)"
    int4 = load_report(DATA / "report_xnnpack_8da4w_mixed_profiled.json")
    assert chart.points[0]["x"] == round(int4.quantization.weight_bytes_per_token / 1e6, 2)


def test_a_recipe_folder_zips_whole_with_its_model_card(tiny_fp32_run, tmp_path):
    from recipes.output.publish import zip_recipe_folder

    folder, report = tiny_fp32_run
    zipped = zip_recipe_folder(folder, tmp_path / "xnnpack-fp32.zip")
    with zipfile.ZipFile(zipped) as archive:
        names = set(archive.namelist())
        assert {"model.pte", "tokenizer.json", "tokenizer_config.json", "report.json", "README.md"} <= names
        assert names == {f.name for f in folder.iterdir() if f.is_file() and f.suffix != ".zip"} | {"README.md"}
        assert archive.read("model.pte") == (folder / "model.pte").read_bytes()
        assert "library_name: executorch" in archive.read("README.md").decode()
    assert not list(tmp_path.glob(".*partial"))


def test_the_estimate_made_before_the_job_stands_beside_the_measured_figures():
    from recipes.output.report import TimeEstimate

    summary = _summary("report_xnnpack_fp32.json")
    report = summary.recipes[0]
    assert summary_rows(summary)[0]["estimated time (s)"] == MISSING  # written before reports carried one
    report.timings.total = 41.26
    report.timings.estimate = TimeEstimate(export=10.0, lower=5.0, other=20.0, total=35.0, fitted_on="134M–3.2B")
    row = summary_rows(summary)[0]
    assert (row["time (s)"], row["estimated time (s)"]) == (41.3, 35.0)
    assert row["peak RSS (GB)"] == round(report.timings.peak_rss_mb / 1e3, 2)
    assert isinstance(row["estimated peak RSS (GB)"], float) and row["estimated peak RSS (GB)"] > 0
    assert list(row).index("estimated time (s)") == list(row).index("time (s)") + 1
    again = type(report).from_dict(json.loads(report.to_json()))
    assert again.timings.estimate == report.timings.estimate


def test_decode_speed_comes_from_the_llm_runner_where_it_ran_and_the_size_counts_the_weights_file():
    from dataclasses import replace

    from recipes.output.summary import recipe_figures

    report = load_report(DATA / "report_xnnpack_8da4w_mixed_profiled.json")
    runtime = report.generations[1]
    runner = replace(runtime, engine="executorch-llm-runner", decode_tokens_per_s=runtime.decode_tokens_per_s * 3)
    with_runner = replace(report, generations=[*report.generations, runner],
                          pte=replace(report.pte, ptd_path="model.ptd", ptd_bytes=2_500_000))
    figures = recipe_figures(with_runner, report.generations[0])
    assert figures.engine == "executorch-llm-runner"
    assert figures.decode_tokens_per_s == round(runner.decode_tokens_per_s, 1)
    assert figures.ptd_mb == 2.5
    alone = recipe_figures(report, report.generations[0])
    assert alone.engine == "executorch-runtime" and alone.ptd_mb is None
