"""The KV cache phase: ExecuTorch's LLM runner (TextLLMRunner) on xnnpack-8da4w programs of one long context
with fp32 and int8 caches, and on optimum-executorch's .pte of the same context: prefill and decode speed and
the process's peak RSS at several positions of a long generation, each (program, position) in its own process.

    python -m bench.kv run --pte FILE --tokenizer-json FILE --hf FOLDER --position 2048 [--new-tokens 64]
    python -m bench.kv floor        (the same process without a program: what every figure's RSS starts from)
    python -m bench.kv attention --hf FOLDER --cache int8 --context 8192   (the cache's work alone, per position)

A measurement at position P prefills P - new_tokens tokens of running text (the evaluation texts chained,
no chat template: the model continues the text rather than answering and stopping) and decodes new_tokens
more, so its decode figure is for positions P - new_tokens .. P. The runner prefills in calls of the program's
get_max_seq_len and stops at an end of sequence (its Python binding has no ignore_eos): a run that stopped
early says so."""
from __future__ import annotations

import argparse
import importlib
import json
import resource
import sys

from bench.measure import median
from recipes.process import thread_policy

# The product's thread policy, before torch loads (as bench/runner.py).
if __name__ == "__main__":
    thread_policy.limit_openmp_default()

BUILTIN_SHAPE = "smollm2-135m"  # the built-in model's shape (bench/scale.py names it so)
POSITIONS = (512, 2048, 8192)
NEW_TOKENS = 64
PROGRAMS = ("fp32 cache", "int8 cache")  # xnnpack-8da4w with --kv-cache fp32 / int8
OPTIMUM = "optimum-pte"
FLOOR = "floor (imports, no program)"
ATTENTION = "attention alone"  # engines "attention alone (<cache>)": bench.kv attention


def running_text_ids(tokenizer, count: int) -> list[int]:
    """`count` token ids of the evaluation texts (quant/eval_text*.txt), chained and repeated."""
    from recipes.evaluation import fidelity  # loads torch, which bench's driver leaves to the processes it starts

    ids = fidelity.eval_token_ids(tokenizer) + fidelity.eval_token_ids(tokenizer, fidelity.HELDOUT_TEXT)
    return (ids * (count // len(ids) + 1))[:count]


def _imports() -> None:
    import torch  # noqa: F401  (loads libtorch, which the runner's extension links against)

    # load torch, which bench's driver leaves to the processes it starts
    from recipes.backends.xnnpack import BACKEND
    from recipes.running.llm_runner import _KERNEL_MODULES

    for name in (*_KERNEL_MODULES, *BACKEND.runtime_imports):
        importlib.import_module(name)


def measure(pte: str, tokenizer_json: str, hf: str, position: int, new_tokens: int, threads: int) -> dict:
    # loads torch, which bench's driver leaves to the processes it starts
    from bench.decode import load_tokenizer, set_runtime_threads
    from recipes.running.llm_runner import _stdout_silenced

    _imports()
    set_runtime_threads(threads)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    tokenizer = load_tokenizer(hf)
    text = tokenizer.decode(running_text_ids(tokenizer, position - new_tokens))
    with _stdout_silenced():
        runner = TextLLMRunner(pte, tokenizer_json)
    stats, pieces = [], []
    with thread_policy.runtime_threads(), _stdout_silenced():
        # warm-up as llama_main --warmup does, on a short prompt
        runner.generate(text[:200], GenerationConfig(max_new_tokens=2, temperature=0.0, echo=False, warming=True))
        runner.reset()
        runner.generate(text, GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, echo=False),
                        token_callback=pieces.append, stats_callback=stats.append)
    figures = json.loads(stats[0].to_json_string())
    prefill_ms = figures["prompt_eval_end_ms"] - figures["inference_start_ms"]
    decode_ms = figures["inference_end_ms"] - figures["prompt_eval_end_ms"]
    return {"position": position, "prompt_tokens": figures["prompt_tokens"], "new_tokens": len(pieces),
            "stopped_early": len(pieces) < new_tokens,
            "prefill_tokens_per_s": round(figures["prompt_tokens"] * 1000 / prefill_ms, 2) if prefill_ms > 0 else None,
            "decode_tokens_per_s": round(figures["generated_tokens"] * 1000 / decode_ms, 2) if decode_ms > 0 else None,
            "model_load_ms": figures["model_load_end_ms"] - figures["model_load_start_ms"],
            "process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "threads": threads, "text": "".join(pieces)[:200]}


def attention_ms(hf: str, cache: str, context: int, positions: tuple[int, ...], threads: int, calls: int = 20
                 ) -> dict:
    """ms per decode step of the cache work alone: every layer's cache write and attention (models/llama.py's
    own methods, on the model's cache shape in `cache`'s dtype), with no weights, lowered as the programs are
    and timed at each position (median of `calls` one-token calls). What the cache costs a decode step,
    whatever the rest of the program does."""
    import statistics
    import time

    import torch
    from transformers import AutoConfig

    # loads torch, which bench's driver leaves to the processes it starts
    from bench.decode import set_runtime_threads
    from bench.floor import CacheAttention
    from models.llama import LlamaShape
    from recipes.backends.xnnpack import BACKEND, xnnpack_partitioners
    from recipes.running.generate import load_runtime_method
    from recipes.lowering.lower import Lowering, lower_to_pte
    from recipes.registry import get_recipe

    set_runtime_threads(threads)
    _imports()
    shape = LlamaShape.from_config(AutoConfig.from_pretrained(hf))
    options = get_recipe("xnnpack-8da4w").export_options(context, {"kv_cache": cache})

    q = torch.randn(1, 1, shape.n_heads, shape.head_dim)
    k, v = torch.randn(1, 1, shape.n_kv_heads, shape.head_dim), torch.randn(1, 1, shape.n_kv_heads, shape.head_dim)
    with torch.no_grad():
        program = torch.export.export(CacheAttention(shape, options).eval(), (q, k, v, torch.tensor([0])), strict=False)
    lowered = lower_to_pte(program, xnnpack_partitioners({}), Lowering(lowering_context=BACKEND.lowering_context))
    _program, method = load_runtime_method(lowered.pte, BACKEND.runtime_imports)
    found = {}
    with thread_policy.runtime_threads():
        for position in positions:
            inputs = [q, k, v, torch.tensor([position - 1])]
            method.execute(inputs)
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                method.execute(inputs)
                times.append(time.perf_counter() - start)
            found[str(position)] = round(statistics.median(times) * 1e3, 3)
    return {"cache": cache, "attention_ms_by_position": found, "layers": shape.n_layers, "threads": threads}


def floor() -> dict:
    """The runner's process with its imports and thread pool, no program loaded."""
    # loads torch, which bench's driver leaves to the processes it starts
    from bench.decode import set_runtime_threads

    _imports()
    set_runtime_threads(2)
    from executorch.extension.llm.runner import TextLLMRunner  # noqa: F401

    return {"process_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def summarize_kv(data: dict) -> dict:
    rows = {}
    for record in data["runs"]:
        key = record["engine"]  # "<program> @ <position>", or the floor
        program, _, position = key.partition(" @ ")
        rows.setdefault(key, {"engine": program, "position": int(position) if position else None, "ok": [],
                              "failed": 0})
        if record["returncode"] == 0 and record["result"]:
            rows[key]["ok"].append({**record["result"], "peak_rss_mb": record["peak_rss_mb"]})
        else:
            rows[key]["failed"] += 1
    summary = {}
    for key, row in rows.items():
        if key.startswith(ATTENTION):
            ok = [r["attention_ms_by_position"] for r in row["ok"]]
            by_position = {p: median([r.get(p) for r in ok]) for p in (ok[0] if ok else {})}
            summary[key] = {"engine": key, "position": None, "runs": len(ok), "failed_runs": row["failed"],
                            "attention_ms_by_position": by_position}
            continue
        ok = row["ok"]
        summary[key] = {"engine": row["engine"], "position": row["position"], "runs": len(ok),
                        "failed_runs": row["failed"],
                        **{k: median([r.get(k) for r in ok]) for k in
                           ("prefill_tokens_per_s", "decode_tokens_per_s", "peak_rss_mb", "prompt_tokens")},
                        "runs_stopped_early": sum(bool(r.get("stopped_early")) for r in ok)}
    return {"rows": summary}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--pte", required=True)
    run.add_argument("--tokenizer-json", required=True)
    run.add_argument("--hf", required=True, help="HF folder: the tokenizer that writes the running text")
    run.add_argument("--position", type=int, required=True)
    run.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    run.add_argument("--threads", type=int, default=2)
    sub.add_parser("floor")
    attention = sub.add_parser("attention")
    attention.add_argument("--hf", required=True)
    attention.add_argument("--cache", required=True)
    attention.add_argument("--context", type=int, required=True)
    attention.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.command == "floor":
        result = floor()
    elif args.command == "attention":
        result = attention_ms(args.hf, args.cache, args.context, POSITIONS, args.threads)
    else:
        result = measure(args.pte, args.tokenizer_json, args.hf, args.position, args.new_tokens, args.threads)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
