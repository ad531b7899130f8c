"""Where a decode step of the Lowerbench .pte spends its time: the xnnpack-8da4w program of the same
checkpoint with one part taken out at a time, timed in one process, round by round in turn with the
full program and optimum's .pte (same runtime loop as bench/decode.py, same prompt, greedy). In one
process the programs loaded first run slower, so `python3 -m bench --phases breakdown` runs the timing
once per rotation of the load order.

    python -m bench.breakdown export --hf FOLDER --variant NAME --out FILE.pte
    python -m bench.breakdown time --hf FOLDER --rounds N [--new-tokens 64] NAME=FILE.pte[:all] ...

The ablated programs compute wrong tokens on purpose: they exist only to be timed, as "this step without
that part". An ablation replaces a method of the model's classes, so each is exported in its own process.
":all" marks a .pte that takes optimum's positions (cache_position[T]) instead of Lowerbench's input_pos[1]."""
from __future__ import annotations

import argparse
import json
import sys

from recipes import thread_policy

# The timing runs in a Lowerbench process (thread_policy.py), set before torch loads; as in bench/decode.py.
if __name__ == "__main__" and sys.argv[1:2] == ["time"]:
    thread_policy.limit_openmp_default()

from bench.decode import load_tokenizer, MAX_SEQ_LEN, runtime_engine_step, set_runtime_threads, _NeverStops  # noqa: E402
from bench.floor import delegated_work  # noqa: E402
from bench.scaling import export_recipe  # noqa: E402
from models.checkpoint import load_folder  # noqa: E402
from models.llama import Attention, RMSNorm  # noqa: E402
from recipes import generate as gen  # noqa: E402
from recipes.atomic_write import write_atomically  # noqa: E402


def _no_sdpa() -> None:
    Attention.attend_cache_custom = lambda self, q, start_pos: q


def _no_cache_write() -> None:
    Attention.write_cache_custom = lambda self, k, v, start_pos: None


def _no_shared_kernels() -> None:
    _no_sdpa()
    _no_cache_write()


def _no_norm_math() -> None:
    RMSNorm.forward = lambda self, x: self.weight * x


def _no_attention() -> None:
    Attention.forward = lambda self, x, rope, start_pos, positions, mask: self.o_proj(x)


# name -> (what the program lacks, the ablation applied before building the module)
ABLATIONS = {
    "full": ("nothing: the xnnpack-8da4w program as shipped", lambda: None),
    "no-sdpa": ("llama::custom_sdpa (its query passed through)", _no_sdpa),
    "no-cache-write": ("llama::update_cache (the caches stay zero)", _no_cache_write),
    "no-shared-kernels": ("both at once, custom_sdpa and update_cache: what is left is Lowerbench's own part "
                          "(the two single savings overlap, so their sum overstates the shared part)",
                          _no_shared_kernels),
    "no-norm-math": ("the RMSNorm arithmetic (the weight multiply stays)", _no_norm_math),
    "no-attention": ("the whole attention but o_proj: q/k/v linear, rope, split, cache write, sdpa; "
                     "one XNNPACK partition instead of 31", _no_attention),
}


def export_variant(hf: str, variant: str, out: str, max_seq_len: int) -> dict:
    ABLATIONS[variant][1]()
    checkpoint = load_folder(hf)
    timings, lowered = export_recipe(checkpoint.config, checkpoint.state_dict, "xnnpack-8da4w", max_seq_len)
    write_atomically(out, lowered.pte)
    d = lowered.delegation
    return {"variant": variant, "delegated_subgraphs": d["delegated_subgraphs"], "delegated_nodes": d["delegated_nodes"],
            "non_delegated_nodes": d["non_delegated_nodes"], "pte_bytes": len(lowered.pte),
            "delegated_work": delegated_work(d),
            "timings_s": {k: round(v, 3) for k, v in timings.items()}}


def time_engines(hf: str, specs: list[str], rounds: int, new_tokens: int, threads: int) -> dict:
    """Every engine loaded once; each round runs one greedy generation per engine, the order reversed
    every other round, so a slow spell of the machine falls on all of them alike."""
    tokenizer = _NeverStops(load_tokenizer(hf))
    set_runtime_threads(threads)
    engines = []
    for spec in specs:
        name, _, path = spec.partition("=")
        positions = "all" if path.endswith(":all") else "start"
        engines.append((name, runtime_engine_step(path.removesuffix(":all"), positions)))
    decode = {name: [] for name, _ in engines}
    prefill = {name: [] for name, _ in engines}
    for i in range(rounds + 1):  # round 0 warms caches and the thread pool; it is not counted
        for name, step in engines if i % 2 else engines[::-1]:
            result = gen.generate(step, gen.ENGINE_RUNTIME, tokenizer, gen.DEFAULT_PROMPT, new_tokens, MAX_SEQ_LEN)
            if i:
                decode[name].append(result.decode_tokens_per_s)
                prefill[name].append(result.prefill_tokens_per_s)
    return {"rounds": rounds, "new_tokens": new_tokens, "threads": threads,
            "engines": {name: {"decode_tokens_per_s": decode[name], "prefill_tokens_per_s": prefill[name]}
                        for name, _ in engines}}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export")
    export.add_argument("--hf", required=True)
    export.add_argument("--variant", required=True, choices=list(ABLATIONS))
    export.add_argument("--out", required=True)
    export.add_argument("--max-seq-len", type=int, default=512)
    timing = sub.add_parser("time")
    timing.add_argument("--hf", required=True)
    timing.add_argument("--rounds", type=int, default=11)
    timing.add_argument("--new-tokens", type=int, default=64)
    timing.add_argument("--threads", type=int, default=2)
    timing.add_argument("engines", nargs="+", help="NAME=FILE.pte, or NAME=FILE.pte:all for optimum's positions")
    args = parser.parse_args()
    if args.command == "export":
        result = export_variant(args.hf, args.variant, args.out, args.max_seq_len)
    else:
        result = time_engines(args.hf, args.engines, args.rounds, args.new_tokens, args.threads)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
