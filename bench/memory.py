"""How fast the machine reads memory, and how many weight bytes one decode step of xnnpack-8da4w reads:
together the memory-bound ceiling a decode figure is judged against. Prints one JSON line.

    python -m bench.memory [--threads 2] [--hf FOLDER]

The decode phase runs it without --hf, in turn with the engines, and works out the weight bytes once itself;
with --hf it also prints the weight bytes and the ceiling.

Read speed: torch.sum over a 512 MiB fp32 tensor (16x the L3 of the machines this runs on, so it comes from
DRAM) on N threads, median of 9 timed passes. A sum streams its input once, as a one-token linear streams
its weights."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

READ_MIB = 512
PASSES = 9

# xnnpack-8da4w: int4 weights in groups of 32, one bf16 scale per group (ExecuTorch hands XNNPACK
# blockwise scales as bf16), so every linear weight costs half a byte plus 2/32 bytes.
INT4_G32_BYTES_PER_WEIGHT = 0.5 + 2 / 32


def read_gb_per_s(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(READ_MIB * 2**20 // 4)
    data.sum()  # first touch and warm-up
    seconds = []
    for _ in range(PASSES):
        start = time.perf_counter()
        data.sum()
        seconds.append(time.perf_counter() - start)
    return READ_MIB * 2**20 / statistics.median(seconds) / 1e9


def decode_weight_bytes_per_token(hf_folder: str) -> int:
    """Bytes of linear weights one decode step reads: every linear of every layer and the output layer,
    int4 g32. The 8-bit embedding contributes one row per token, which is left out."""
    # loads torch, which bench's driver leaves to the processes it starts
    from models.sources.config import read_config
    from models.llama import LlamaShape

    s = LlamaShape.from_config(read_config(Path(hf_folder)))
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    per_layer = s.hidden * (q + 2 * kv) + q * s.hidden + 3 * s.hidden * s.intermediate
    weights = s.n_layers * per_layer + s.hidden * s.vocab_size
    return int(weights * INT4_G32_BYTES_PER_WEIGHT)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hf", help="a checkpoint folder: also print its decode weight bytes and the ceiling")
    args = parser.parse_args()
    rate = read_gb_per_s(args.threads)
    result = {"threads": args.threads, "read_gb_per_s": round(rate, 2), "read_mib": READ_MIB}
    if args.hf:
        weight_bytes = decode_weight_bytes_per_token(args.hf)
        result.update(decode_weight_mb_per_token=round(weight_bytes / 1e6, 2),
                      memory_bound_tokens_per_s=round(rate * 1e9 / weight_bytes, 1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
