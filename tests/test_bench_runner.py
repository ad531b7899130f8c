"""bench/runner.py's summary of the runner phase: medians with per-run ranges, ratios paired within a run."""
from bench.runner import paired_ratio, summarize_runner
from bench.table import runner_table

A, B = "lowerbench-pte · executorch-llm-runner", "optimum-pte · executorch-llm-runner"


def _run(engine, run, prefill, decode, new_tokens=8, returncode=0):
    result = {"engine": "executorch-llm-runner", "prompt_tokens": 5, "new_tokens": new_tokens, "text": "t",
              "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "time_to_first_token_ms": 10,
              "model_load_ms": 100, "stopped_early": new_tokens < 8}
    return {"engine": engine, "run": run, "returncode": returncode, "result": result if returncode == 0 else None}


def test_ratio_pairs_runs_by_index_so_a_slow_run_slows_both_sides():
    # run 1 is slow for both: the ratio of medians would be 1.5, the paired ratio stays 2
    runs = [_run(A, 0, 100, 200), _run(B, 0, 100, 100), _run(A, 1, 100, 20), _run(B, 1, 100, 10),
            _run(A, 2, 100, 300), _run(B, 2, 100, 150)]
    assert paired_ratio(runs, A, B, "decode_tokens_per_s") == 2.0


def test_ratio_leaves_out_a_run_where_one_side_failed():
    runs = [_run(A, 0, 100, 200), _run(B, 0, 100, 100), _run(A, 1, 100, 900), _run(B, 1, 0, 0, returncode=1)]
    assert paired_ratio(runs, A, B, "decode_tokens_per_s") == 2.0


def test_summary_has_medians_ranges_early_stops_and_named_ratios():
    runs = [_run(A, 0, 10, 30), _run(B, 0, 20, 10), _run(A, 1, 30, 10), _run(B, 1, 40, 20, new_tokens=6),
            _run(A, 2, 20, 20), _run(B, 2, 60, 30)]
    data = {"runs": runs, "settings": {"ratios": [["A ÷ B", A, B], ["missing", A, "nobody"]]}}
    summary = summarize_runner(data)
    row = summary["engines"][A]
    assert (row["runs"], row["decode_tokens_per_s"], row["decode_tokens_per_s_range"]) == (3, 20, [10, 30])
    assert summary["engines"][B]["new_tokens"] == 6 and summary["engines"][B]["runs_stopped_early"] == 1
    assert [r["what"] for r in summary["ratios"]] == ["A ÷ B"]
    assert summary["ratios"][0]["prefill_tokens_per_s"] == 0.5  # median of 0.5, 0.75, 0.33


def test_table_shows_every_engine_its_range_and_the_ratios():
    runs = [_run(A, 0, 10, 30), _run(B, 0, 20, 10, new_tokens=6)]
    data = {"runs": runs, "skipped": {}, "settings": {"ratios": [["A ÷ B", A, B]], "new_tokens": 8, "threads": 2,
                                                      "max_seq_len": 512, "prompt": "p"},
            "meta": {"date": "d", "machine": {"cpu": "c", "cores": 2, "ram_gb": 1}, "runs_requested": 1,
                     "load_average_before": [3.0], "load_average_after": [4.0]}}
    data.update(summarize_runner(data))
    text = "\n".join(runner_table(data))
    assert f"| {A} | 10.0 | 30.0 | 30.0–30.0 |" in text
    assert "6 (1 stopped early)" in text
    assert "| A ÷ B | 0.50× | 3.00× |" in text
    assert "3.0 / 4.0" in text
