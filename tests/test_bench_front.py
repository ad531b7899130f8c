"""bench/front.py's pure parts: which group sizes a model takes, the rows of its reports, and which rows beat
optimum-executorch's default (HQQ scale-only qparams, group 32) on both decode speed and fidelity."""
from bench.front import (RANDOM_WEIGHTS, beats_default, builtin_jobs, fitting_group_sizes, front_row, keep_unmeasured,
                         report_extract, summarize_front)
from bench.scale_models import CONFIGS
from bench.table import front_table
from recipes.output.report import Report

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
                "num_hidden_layers": 30, "vocab_size": 49152}
META = {"date": "2026-01-01T00:00:00+00:00", "machine": {"cpu": "Some CPU", "cores": 2, "ram_gb": 24},
        "runs_requested": 3, "load_average_before": [1.0], "load_average_after": [1.0], "note": ""}


def _report(bytes_per_token, ppl_ratio, decode, engine="executorch-llm-runner", units_8bit=None):
    mixed = {"units_8bit": units_8bit, "extra_bytes_per_token": 2_000_000} if units_8bit else None
    return {"quantization": {"weight_bytes_per_token": bytes_per_token,
                             **({"mixed_precision": mixed} if mixed else {})},
            "fidelity": None if ppl_ratio is None else {
                "engine": "executorch-runtime", "perplexity_ratio": ppl_ratio, "top1_agreement_percent": 60.0,
                "heldout": {"perplexity_ratio": round(ppl_ratio + 0.1, 3), "top1_agreement_percent": 58.0},
                "layers": {"layers": [{"big": "per-layer map"}]}},
            "generations": [{"engine": "eager-fp32", "decode_tokens_per_s": 5.0, "tokens": [1]},
                            {"engine": engine, "decode_tokens_per_s": decode, "prefill_tokens_per_s": 200.0,
                             "new_tokens": 32, "tokens": [1, 2]}],
            "timings_s": {"quantize": 3.0}, "pte": {"bytes": 100_000_000}}


def _run(algorithm, group, report, budget=0.0, shape="smollm2-135m", full=True, returncode=0):
    return {"shape": shape, "algorithm": algorithm, "group_size": group, "mixed_precision_budget": budget,
            "full_job": full, "returncode": returncode, "wall_s": 100.0, "peak_rss_mb": 2000.0,
            "report": report_extract(Report.from_dict(report))}


def _row(algorithm, group, ppl_ratio, decode, engine="executorch-llm-runner"):
    return front_row(_run(algorithm, group, _report(70_000_000, ppl_ratio, decode, engine)))


def test_only_group_sizes_that_divide_every_linear_width_are_tried_in_the_given_order():
    assert fitting_group_sizes(SMOLLM2_135M, [32, 64, 128, 256]) == [32, 64]
    assert fitting_group_sizes(CONFIGS["llama-3.2-1b"], [32, 128, 64, 256]) == [32, 128, 64, 256]
    assert fitting_group_sizes({**SMOLLM2_135M, "intermediate_size": 1440}, [32, 64, 128, 256]) == [32]


def test_the_built_in_jobs_are_every_algorithm_at_every_fitting_group_plus_the_mixed_precision_jobs():
    jobs = builtin_jobs([32, 64])
    assert len(jobs) == 14
    assert {(j["algorithm"], j["group_size"]) for j in jobs if not j["mixed_precision_budget"]} == {
        (a, g) for a in ("minmax", "hqq", "awq", "spinquant", "gptq", "awq-gptq") for g in (32, 64)}
    assert [(j["algorithm"], j["group_size"], j["mixed_precision_budget"]) for j in jobs][:5] == [
        ("minmax", 32, 0.0), ("minmax", 64, 0.0), ("hqq", 32, 0.0), ("hqq", 64, 0.0), ("hqq", 32, 0.15)]
    assert jobs[-1] == {"algorithm": "awq-gptq", "group_size": 32, "mixed_precision_budget": 0.15}
    assert all(not j["mixed_precision_budget"] for j in builtin_jobs([64]))
    assert [(j["algorithm"], j["mixed_precision_budget"]) for j in builtin_jobs([32], ["minmax", "gptq"], ["gptq"])] == [
        ("minmax", 0.0), ("gptq", 0.0), ("gptq", 0.15)]


def test_a_row_beats_the_default_only_when_both_faster_and_closer_to_fp32_on_the_same_engine():
    default = _row("hqq", 32, 1.5, 100.0)
    assert beats_default(_row("minmax", 32, 1.4, 101.0), default)
    assert not beats_default(_row("minmax", 64, 1.6, 120.0), default)  # faster, less faithful
    assert not beats_default(_row("awq", 32, 1.3, 99.0), default)  # more faithful, slower
    assert not beats_default(_row("minmax", 32, 1.4, 101.0, engine="executorch-runtime"), default)
    assert not beats_default(default, default)
    assert not beats_default(_row("minmax", 32, None, 101.0), default)  # fidelity not measured
    assert not beats_default(_row("minmax", 32, 1.4, 101.0), default, noise=0.03)  # within one program's spread
    assert beats_default(_row("minmax", 64, 1.4, 104.0), default, noise=0.03)


MIXED = ["model.layers.0.self_attn.v_proj", "model.layers.0.mlp.down_proj", "model.layers.29.mlp.down_proj", "lm_head"]


def test_the_summary_reads_each_report_marks_the_winners_and_checks_the_bytes_per_algorithm():
    runs = [_run("hqq", 32, _report(70_000_000, 1.5, 100.0)),
            _run("minmax", 32, _report(70_000_000, 1.4, 100.5)),
            _run("minmax", 64, _report(66_000_000, 1.45, 110.0)),
            _run("hqq", 64, _report(67_000_000, 1.8, 108.0)),
            _run("minmax", 32, _report(72_000_000, 1.2, 95.0, units_8bit=MIXED), budget=0.15),
            _run("hqq", 128, _report(60_000_000, None, None), shape="llama-3.2-1b", full=False)]
    decode = [{"shape": "llama-3.2-1b", "group_size": 128, "engine": "llama-3.2-1b g128", "run": i, "returncode": 0,
               "result": {"decode_tokens_per_s": rate, "prefill_tokens_per_s": 50.0, "new_tokens": 64}}
              for i, rate in enumerate((10.0, 12.0, 11.0))]
    data = {"meta": META, "runs": runs, "decode": decode, "skipped": {},
            "settings": {"recipe": "xnnpack-8da4w", "max_seq_len": 512, "threads": 2, "decode_runs": 3}}
    data.update(summarize_front(data))
    rows = {(r["shape"], r["name"]): r for r in data["rows"]}
    minmax = rows[("smollm2-135m", "minmax g32")]
    assert (minmax["heldout_perplexity_ratio"], minmax["decode_engine"], minmax["decode_tokens_per_s"]) == (1.5, "executorch-llm-runner", 100.5)
    assert data["decode_noise"] == round(110 / 108 - 1, 4)
    assert rows[("smollm2-135m", "minmax g64")]["beats_default"] and not minmax["beats_default"]  # minmax g32: within noise
    assert not rows[("smollm2-135m", "hqq g64")]["beats_default"]
    assert rows[("smollm2-135m", "minmax g32 +8-bit 15%")]["units_8bit"] == MIXED
    assert data["same_bytes_across_algorithms"] == {
        "smollm2-135m g32": {"algorithms": ["hqq", "minmax"], "same": True},
        "smollm2-135m g64": {"algorithms": ["minmax", "hqq"], "same": False}}
    big = rows[("llama-3.2-1b", "hqq g128")]
    assert (big["decode_tokens_per_s"], big["decode_runs"], big["fidelity_engine"]) == (11.0, 3, RANDOM_WEIGHTS)
    assert big["beats_default"] is None
    text = "\n".join(front_table(data))
    assert "| smollm2-135m (built-in) | minmax | 64 | – | 66.00 |" in text and text.count("| **yes** |") == 1
    assert f"| llama-3.2-1b (random weights) | hqq | 128 | – | 60.00 | 100.0 | {RANDOM_WEIGHTS} |" in text
    assert "layer 0 v_proj, down_proj; layer 29 down_proj and the output layer, +2.00 MB/token" in text
    assert "2026-01-01" in text and "Some CPU" in text


def test_a_later_invocation_keeps_the_jobs_and_programs_it_did_not_measure():
    old = {"meta": {"date": "before"}, "skipped": {"llama-3.2-1b g256": "failed"},
           "runs": [_run("minmax", 32, _report(1, 1.5, 1.0)), _run("minmax", 32, _report(1, None, None), shape="1b", full=False)],
           "decode": [{"shape": "1b", "group_size": 32, "engine": "1b g32"}]}
    new = {"runs": [_run("minmax", 128, _report(1, None, None), shape="1b", full=False)],
           "decode": [{"shape": "1b", "group_size": 128, "engine": "1b g128"}], "skipped": {}, "settings": {}}
    meta = {"date": "later"}
    keep_unmeasured(old, meta, new)
    assert [(r["shape"], r["group_size"]) for r in new["runs"]] == [("smollm2-135m", 32), ("1b", 32), ("1b", 128)]
    assert [r["group_size"] for r in new["decode"]] == [32, 128]
    assert meta["earlier_meta"]["date"] == "before"


def test_a_save_earlier_in_the_same_invocation_is_not_an_earlier_invocation():
    first = {"meta": {"date": "now", "earlier_meta": {"date": "before"}}, "skipped": {},
             "runs": [_run("minmax", 32, _report(1, 1.5, 1.0)), _run("minmax", 64, _report(1, 1.6, 1.0))], "decode": []}
    again = {"runs": [_run("minmax", 32, _report(1, 1.5, 1.0))], "decode": [], "skipped": {}, "settings": {}}
    meta = {"date": "now"}
    keep_unmeasured(first, meta, again)
    assert len(again["runs"]) == 2 and meta["earlier_meta"] == {"date": "before"}


def test_a_mixed_precision_row_of_the_older_layout_names_its_decoder_layers():
    """Rows recorded before units_8bit held decoder layer indices under layers_8bit."""
    from bench.table import _front_8bit

    old = {"layers_8bit": [0, 24], "units_8bit": None, "mixed_precision_budget": 0.15, "extra_bytes_per_token": 3_000_000}
    assert _front_8bit(old) == "layer 0 (all linears); layer 24 (all linears), +3.00 MB/token"
    assert _front_8bit({**old, "layers_8bit": None}) == "none fit"


def test_a_timed_built_in_program_replaces_its_sample_speed_and_decides_which_row_is_faster(tmp_path):
    """A sample generation is too short to time; each built-in .pte's median over the timed runs stands instead,
    keyed by its job, and a later timing of one program keeps the others'."""
    from bench.front import TIMED_ENGINE, builtin_programs

    runs = [_run("hqq", 32, _report(70_000_000, 1.5, 300.0)), _run("minmax", 64, _report(66_000_000, 1.4, 90.0)),
            _run("minmax", 32, _report(72_000_000, 1.2, 95.0, units_8bit=MIXED), budget=0.15)]

    def timed(name, rates):
        group = int(name.split(" g")[1][:2])
        return [{"shape": "smollm2-135m", "name": name, "group_size": group, "engine": f"x {name}",
                 "returncode": 0, "run": i,
                 "result": {"decode_tokens_per_s": rate, "prefill_tokens_per_s": 900.0, "new_tokens": 64}}
                for i, rate in enumerate(rates)]

    decode = timed("hqq g32", (200.0, 210.0, 205.0)) + timed("minmax g64", (230.0, 220.0, 226.0))
    data = {"meta": META, "runs": runs, "decode": decode + timed("minmax g32 +8-bit 15%", (180.0,)), "skipped": {},
            "settings": {"recipe": "xnnpack-8da4w", "max_seq_len": 512, "threads": 2, "decode_runs": 3}}
    data.update(summarize_front(data))
    rows = {r["name"]: r for r in data["rows"]}
    assert (rows["hqq g32"]["decode_tokens_per_s"], rows["hqq g32"]["decode_runs"]) == (205.0, 3)
    assert rows["minmax g64"]["decode_engine"] == rows["hqq g32"]["decode_engine"] == TIMED_ENGINE
    # the sample speeds (300 against 90) would say the opposite
    assert rows["minmax g64"]["beats_default"]
    assert rows["minmax g32 +8-bit 15%"]["decode_tokens_per_s"] == 180.0 and not rows["minmax g32 +8-bit 15%"]["beats_default"]
    assert "median of 3 decode runs" in "\n".join(front_table(data))

    old = {"meta": {"date": "before"}, "skipped": {}, "runs": runs, "decode": decode}
    new = {"runs": [], "decode": timed("minmax g64", (240.0,)), "skipped": {}, "settings": {}}
    keep_unmeasured(old, {"date": "later"}, new)
    assert sorted((r["name"], r["result"]["decode_tokens_per_s"]) for r in new["decode"] if r["name"] == "minmax g64") == [
        ("minmax g64", 240.0)] and len(new["decode"]) == 4

    pte = tmp_path / "model.pte"
    pte.write_bytes(b"pte")
    on_disk = [{**runs[0], "pte": str(pte)}, {**runs[1], "pte": str(tmp_path / "gone.pte")}]
    assert builtin_programs(on_disk, "smollm2-135m") == {"hqq g32": on_disk[0]}


def test_a_row_reads_the_stored_extract_back_as_its_report():
    """The front stores an extract of each report (report_extract) and reads it back as a Report; a run that wrote
    no report.json stores none, and its row says so."""
    row = _row("hqq", 32, 1.4, 101.0)
    assert (row["pte_mb"], row["quantize_s"], row["weight_mb_per_token"]) == (100.0, 3.0, 70.0)
    assert (row["decode_engine"], row["prefill_tokens_per_s"], row["new_tokens"]) == ("executorch-llm-runner", 200.0, 32)
    assert (row["fidelity_engine"], row["heldout_top1_agreement_percent"], row["units_8bit"]) == (
        "executorch-runtime", 58.0, None)
    failed = front_row({**_run("hqq", 32, _report(1, None, None)), "report": None, "returncode": 1})
    assert not failed["ok"] and failed["pte_mb"] is None and failed["decode_tokens_per_s"] is None
