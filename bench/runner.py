"""One .pte in ExecuTorch's own LLM runner (TextLLMRunner, through recipes/running/llm_runner.py as the product drives
it), one greedy generation, in its own process; prints one JSON line with the runner's own statistics.

    python -m bench.runner --pte FILE --tokenizer-json FILE --hf FOLDER [--threads 2] [--new-tokens 64]

Also the runner phase's summary (summarize_runner): medians, per-run ranges and same-run ratios of the runner
against optimum's .pte and against the Python step loop (bench/decode.py) on the same .pte."""
from __future__ import annotations

import argparse
import json
import statistics

from recipes.process import thread_policy
from bench.measure import median, paired_ratio_by_run

RUNNER = "executorch-llm-runner"  # this engine's name: ExecuTorch's TextLLMRunner, its own statistics

# As for bench/decode.py's .pte engines: the product's thread policy, applied before torch loads.
if __name__ == "__main__":
    thread_policy.limit_openmp_default()

# ExecuTorch's Python binding of the runner (1.5.1) has no ignore_eos, so the runner stops at an end of
# sequence; a prompt whose answer runs long keeps both programs generating the full count.
LONG_ANSWER_PROMPT = "Write a long story about a dragon who learns to fly."


def generate_in_runner(pte: str, tokenizer_json: str, hf: str, prompt: str, new_tokens: int, threads: int) -> dict:
    # loads torch, which bench's driver leaves to the processes it starts
    from bench.decode import load_tokenizer, set_runtime_threads
    from recipes.running.llm_runner import generate_with_runner
    from recipes.backends.xnnpack import BACKEND

    # The runner's extension links the pybindings' runtime, so they share one thread pool.
    set_runtime_threads(threads)
    result = generate_with_runner(pte, tokenizer_json, load_tokenizer(hf), prompt, new_tokens,
                                  runtime_imports=BACKEND.runtime_imports).to_dict()
    result.pop("pieces")
    return {**result, "requested_new_tokens": new_tokens, "stopped_early": result["new_tokens"] < new_tokens}


def _spread(values: list) -> list | None:
    values = [v for v in values if v is not None]
    return [min(values), max(values)] if values else None


def summarize_engine(results: list[dict]) -> dict:
    """Medians and [min, max] of one engine's successful runs."""
    rates = {key: [r.get(key) for r in results] for key in
             ("prefill_tokens_per_s", "decode_tokens_per_s", "time_to_first_token_ms", "model_load_ms")}
    row = {"runs": len(results), **{key: median(v) for key, v in rates.items()},
           **{f"{key}_range": _spread(v) for key, v in rates.items() if key.endswith("per_s")}}
    if results:
        first = results[0]
        row.update(engine=first["engine"], prompt_tokens=first["prompt_tokens"],
                   new_tokens=min(r["new_tokens"] for r in results), text=first["text"],
                   runs_stopped_early=sum(bool(r.get("stopped_early")) for r in results))
    return row


def paired_ratio(runs: list[dict], numerator: str, denominator: str, key: str) -> float | None:
    """Median over runs of numerator ÷ denominator within the same run index (bench.measure)."""
    return paired_ratio_by_run(runs, numerator, denominator, side=lambda r: r["engine"],
                               value=lambda r: r["returncode"] == 0 and r["result"] and r["result"].get(key))


def summarize_runner(data: dict) -> dict:
    runs = data["runs"]
    engines = {name: summarize_engine([r["result"] for r in runs if r["engine"] == name and r["returncode"] == 0
                                       and r["result"]])
               for name in dict.fromkeys(r["engine"] for r in runs)}
    ratios = []
    for label, numerator, denominator in data["settings"]["ratios"]:
        if numerator in engines and denominator in engines:
            ratios.append({"what": label, "numerator": numerator, "denominator": denominator,
                           **{key: paired_ratio(runs, numerator, denominator, key)
                              for key in ("prefill_tokens_per_s", "decode_tokens_per_s")}})
    return {"engines": engines, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pte", required=True)
    parser.add_argument("--tokenizer-json", required=True, help="the tokenizer.json the runner loads")
    parser.add_argument("--hf", required=True, help="HF folder: the chat template and the step loop's tokenizer")
    parser.add_argument("--prompt", default=LONG_ANSWER_PROMPT)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    result = generate_in_runner(args.pte, args.tokenizer_json, args.hf, args.prompt, args.new_tokens, args.threads)
    result.update(threads=args.threads, thread_policy=thread_policy.policy_active())
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
