"""bench/scale.py's summary of the scale phase: Lowerbench ÷ optimum-cli per shape, paired within a run."""
from bench.scale import DEFAULT_ALGORITHM, in_runner, lowerbench_peer, summarize_scale
from bench.table import scale_table

PEER = "lowerbench xnnpack-8da4w"


def _export(shape, peer, run, wall, peak, pte=1000, returncode=0):
    return {"shape": shape, "peer": peer, "run": run, "wall_s": wall, "peak_rss_mb": peak, "pte_bytes": pte,
            "returncode": returncode}


def _decode(shape, engine, run, prefill, decode):
    return {"shape": shape, "engine": engine, "run": run, "returncode": 0,
            "result": {"prompt_tokens": 40, "new_tokens": 64, "prefill_tokens_per_s": prefill,
                       "decode_tokens_per_s": decode}}


def _data():
    # run 1 is slow on both sides: the paired ratio stays 0.5 where a ratio of medians would not
    runs = [_export("1b", PEER, 0, 100, 4000), _export("1b", "optimum", 0, 200, 8000, pte=1250),
            _export("1b", PEER, 1, 400, 4000), _export("1b", "optimum", 1, 800, 8000, pte=1250),
            _export("3b", PEER, 0, 300, 9000), _export("3b", "optimum", 0, 0, 0, returncode=-9),
            # Lowerbench's default algorithm, in the same runs: 0.6x optimum in run 0, 0.4x in run 1
            _export("1b", lowerbench_peer(DEFAULT_ALGORITHM), 0, 120, 4100),
            _export("1b", lowerbench_peer(DEFAULT_ALGORITHM), 1, 320, 4100)]
    decode = [_decode("1b", "lowerbench-pte", 0, 100, 20), _decode("1b", "optimum-pte", 0, 125, 20),
              _decode("1b", "lowerbench-pte", 1, 50, 10), _decode("1b", "optimum-pte", 1, 60, 11),
              _decode("1b", in_runner("lowerbench-pte"), 0, 110, 22), _decode("1b", in_runner("optimum-pte"), 0, 100, 20)]
    return {"meta": {"date": "d", "machine": {"cpu": "c", "cores": 2, "ram_gb": 24}, "runs_requested": 2, "load_average_before": [1],
                     "load_average_after": [1], "note": ""}, "runs": runs, "decode": decode, "skipped": {}}


def test_ratios_pair_the_runs_and_leave_out_a_shape_whose_peer_failed():
    ratios = summarize_scale(_data())["ratios"]
    assert [r["shape"] for r in ratios] == ["1b"]
    q = ratios[0]["lowerbench_over_optimum"]
    assert (q["export_wall"], q["peak_rss"], q["pte_bytes"]) == (0.5, 0.5, 0.8)
    assert q["default_export_wall"] == 0.5  # its own pairs, not the hqq peer's
    assert q["decode_tokens_per_s"] == round((1.0 + 10 / 11) / 2, 3)
    # the same programs in ExecuTorch's LLM runner, paired apart from the step loop
    assert (q["runner_prefill_tokens_per_s"], q["runner_decode_tokens_per_s"]) == (1.1, 1.1)


def test_table_names_the_engine_and_shows_the_ratios():
    data = _data()
    data.update(summarize_scale(data))
    text = "\n".join(scale_table(data))
    assert "| 1b | lowerbench-pte (executorch-runtime step loop) | 40 |" in text
    assert "| 1b | lowerbench-pte · executorch-llm-runner | 40 |" in text
    assert "| 1b | 0.50× | 0.50× | 0.50× | 0.80× |" in text and "| 1.10× | 1.10× |" in text


def test_a_later_invocation_keeps_the_shapes_it_did_not_measure():
    from bench.__main__ import keep_other_shapes

    old = {**_data(), "skipped": {"3b optimum": "no venv", "2b optimum": "no venv"}}
    new = {"runs": [_export("3b", PEER, 0, 310, 9100)], "decode": [], "skipped": {},
           "settings": {"shapes": ["3b"]}}
    meta = {"date": "later"}
    keep_other_shapes(old, meta, new)
    assert [r["shape"] for r in new["runs"]] == ["1b"] * 6 + ["3b"]
    assert len(new["decode"]) == 6 and new["skipped"] == {"2b optimum": "no venv"}
    assert meta["earlier_meta"]["date"] == "d"


def test_a_later_invocation_with_peers_keeps_the_other_peers_of_its_shapes():
    from bench.__main__ import keep_other_shapes

    old = _data()
    new = {"runs": [_export("1b", PEER, 0, 300, 3000)], "decode": [], "skipped": {"1b optimum": "skipped with --skip"},
           "settings": {"shapes": ["1b"]}}
    keep_other_shapes(old, {"date": "later", "peers": [PEER]}, new)
    one_b = [r for r in new["runs"] if r["shape"] == "1b"]
    assert [(r["peer"], r["wall_s"]) for r in one_b if r["peer"] == PEER] == [(PEER, 300)]
    assert [r["peer"] for r in one_b].count("optimum") == 2
    assert sorted(r["engine"] for r in new["decode"]) == ["optimum-pte", "optimum-pte", in_runner("optimum-pte")]
    assert new["skipped"] == {}


def test_a_row_reads_the_stage_peaks_and_the_estimate_from_the_runs_stored_report():
    data = _data()
    memory = {"peak_rss_mb_by_stage": {"load": 900.0, "lower": 4000.0}, "peak_rss_mb": 4000.0,
              "estimate": {"peak_rss_bytes": 4 * 10**9, "reference_dtype": "torch.float32"}}
    for run in data["runs"]:
        if run["peer"] == PEER:
            run.update(memory=memory, recipe="xnnpack-8da4w", full_job=True, estimate_gb=4.1)
    summary = summarize_scale(data)
    row = next(r for r in summary["shapes"] if (r["shape"], r["peer"]) == ("1b", PEER))
    assert row["stage_peaks_mb"] == {"load": 900.0, "lower": 4000.0} and row["estimate_gb"] == 4.1
    assert {check["reference_dtype"] for check in summary["estimate_checks"]} == {"torch.float32"}
    optimum = next(r for r in summary["shapes"] if (r["shape"], r["peer"]) == ("1b", "optimum"))
    assert "stage_peaks_mb" not in optimum  # optimum-cli writes no report
