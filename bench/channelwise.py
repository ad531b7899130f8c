"""What int4 with one scale per output channel (the Neural Engine's c4w) loses against int4 in groups of 32, per
algorithm, on the built-in model: each configuration's linears quantized as its recipe does, run eagerly in PyTorch
(the Core ML programs do not run here) and scored like every recipe (recipes/fidelity.py, both texts). c4w runs in
fp16 as its recipe's module does; group-wise int4 (int4-weight, coreml-int4's scheme) in fp32, as coreml-int4's
stand-in does; `c4w-fp32` is c4w's weights in fp32, which separates the grid's loss from fp16's.

    python3 -m bench.channelwise [--out bench/results/channelwise.json] [--algorithms minmax,hqq,awq]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch

from models.checkpoint import load_checkpoint
from models.llama import ExportOptions, build_exportable
from quant.quantize import UnitQuantizer
from recipes import fidelity
from recipes.generate import eager_step

MAX_SEQ_LEN = 512
# (label, scheme, module dtype)
CONFIGURATIONS = (("int4-weight g32", "int4-weight", torch.float32), ("c4w", "c4w", torch.float16),
                  ("c4w-fp32", "c4w", torch.float32))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def score(module, texts) -> dict:
    step = eager_step(module)
    figures = {}
    for name, scored in texts.items():
        figures[name] = fidelity.compare_step(step, scored.ids, MAX_SEQ_LEN, scored.logits, scored.targets)
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/channelwise.json")
    parser.add_argument("--algorithms", default="minmax,hqq,awq")
    args = parser.parse_args(argv)
    checkpoint = load_checkpoint(None)
    reference = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(MAX_SEQ_LEN), tie_output=True)
    texts = {}
    for name, path in (("eval", fidelity.EVAL_TEXT), ("heldout", fidelity.HELDOUT_TEXT)):
        ids = fidelity.eval_token_ids(checkpoint.tokenizer, path)
        texts[name] = fidelity.score_text(eager_step(reference), ids, MAX_SEQ_LEN)
    del reference
    rows = []
    for algorithm in args.algorithms.split(","):
        for label, scheme, dtype in CONFIGURATIONS:
            options = {"quant_algorithm": algorithm, **({"group_size": 32} if scheme == "int4-weight" else {})}
            started = time.perf_counter()
            quantizer = UnitQuantizer(scheme, options, checkpoint.tokenizer, MAX_SEQ_LEN)
            module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(MAX_SEQ_LEN),
                                      transform_unit=quantizer)
            module.to(dtype)  # c4w: quantized in fp32 and cast, as its recipe does (quant.quantize.cast_quantized)
            quantize_s = time.perf_counter() - started
            figures = score(module, texts)
            rows.append({"configuration": label, "scheme": scheme, "algorithm": algorithm,
                         "compute_dtype": str(dtype).replace("torch.", ""), "quantize_s": round(quantize_s, 1),
                         **figures})
            print(json.dumps(rows[-1]), flush=True)
            del module
            gc.collect()
    result = {"date": date.today().isoformat(), "cpu": cpu_name(), "model": "built-in SmolLM2-135M-Instruct",
              "max_seq_len": MAX_SEQ_LEN, "engine": "eager PyTorch", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
