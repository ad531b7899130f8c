"""GPTQ's quantize time at a published model's shape, on random weights (bench/scale_models.py's configs):

    python3 -m bench.gptq_time [llama-3.2-1b] [--layers 1,2] [--vocab-fraction 8]
    python3 -m bench.gptq_time [llama-3.2-1b] --parts      (each step of one gate_proj and of one down_proj alone)

Builds the shape's module with one, then two decoder layers, and times quant/gptq.py's apply_gptq on each over
GPTQ_CALIBRATION_TOKENS random tokens in windows of 512: the second minus the first is one decoder layer. The output
layer's work grows with its rows alone, so it is built with 1 / vocab-fraction of the vocabulary and its time (the
first run less one layer) scaled back up: the whole model's time is layers × one layer + that. Random weights time
as real ones do: GPTQ's work depends on the shapes and the token count, not on the values."""
from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import LlamaConfig

from bench.scale_models import CONFIGS
from models.sources.random_checkpoint import checkpoint_shapes
from models.llama import ExportOptions, build_exportable
from quant import gptq
from quant.gptq import GPTQ_CALIBRATION_TOKENS, apply_gptq
from quant.schemes import SCALE_DTYPE_8DA4W, int4_weight_with_scales

WINDOW = 512


def _module(name: str, layers: int, vocab: int):
    config = {**CONFIGS[name], "num_hidden_layers": layers, "vocab_size": vocab}
    generator = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(shape, generator=generator) * (1.0 if len(shape) == 1 else 0.02)).to(torch.bfloat16)
             for k, shape in checkpoint_shapes(config).items()}
    state.update({k: torch.ones_like(v) for k, v in state.items() if v.dim() == 1})
    fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    return build_exportable(LlamaConfig(**fields), state, ExportOptions(WINDOW, attention="custom",
                                                                         norm="linear-mean", fuse_qkv=True))


def time_gptq(name: str, layers: int, vocab: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of apply_gptq on the shape with `layers` decoder layers."""
    module = _module(name, layers, vocab)
    generator = torch.Generator().manual_seed(1)
    windows = [torch.randint(0, vocab, (1, WINDOW), generator=generator)
               for _ in range(GPTQ_CALIBRATION_TOKENS // WINDOW)]
    start, cpu = time.perf_counter(), time.process_time()
    apply_gptq(module, windows, 32, int4_weight_with_scales("int8_asym_per_token", SCALE_DTYPE_8DA4W))
    return time.perf_counter() - start, time.process_time() - cpu


def time_parts(name: str) -> dict:
    """CPU seconds of each step GPTQ takes on the shape's gate_proj and down_proj (random weights, a Hessian of
    GPTQ_CALIBRATION_TOKENS random inputs): the Hessian, the scales' clipping search, the column loop, the refit."""
    config, generator, parts = CONFIGS[name], torch.Generator().manual_seed(2), {}
    for linear, (rows, columns) in {"gate_proj": (config["intermediate_size"], config["hidden_size"]),
                                    "down_proj": (config["hidden_size"], config["intermediate_size"])}.items():
        inputs = torch.randn(gptq.GPTQ_CALIBRATION_TOKENS // WINDOW, WINDOW, columns, generator=generator)
        weight = torch.randn(rows, columns, generator=generator) * 0.02

        def timed(label, step):
            cpu = time.process_time()
            result = step()
            parts[f"{linear} {label}"] = round(time.process_time() - cpu, 2)
            return result

        def hessian():
            if hasattr(gptq, "_Hessian"):
                summed = gptq._Hessian(columns)
                for x in inputs:
                    summed.add(x[None])
                return summed.value()
            from torchao.prototype.gptq.observer import GPTQObserverTensor  # the observer GPTQ read before

            observer = GPTQObserverTensor.from_hp(weight)
            for x in inputs:
                torch.nn.functional.linear(x[None], observer)
            return observer.hessian

        h = timed("hessian", hessian)
        timed("group_scales", lambda: gptq.group_scales(weight, 32))
        values, scales = timed("gptq_weight (group_scales included)", lambda: gptq.gptq_weight(weight, h, 32))
        timed("refit_scales", lambda: gptq.refit_scales(weight, h, values, scales, 32))
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", nargs="?", default="llama-3.2-1b")
    parser.add_argument("--layers", default="1,2")
    parser.add_argument("--vocab-fraction", type=int, default=8)
    parser.add_argument("--parts", action="store_true")
    args = parser.parse_args()
    if args.parts:
        print(json.dumps({"shape": args.shape, "cpu_s": time_parts(args.shape)}))
        return
    one, two = (int(n) for n in args.layers.split(","))
    vocab = CONFIGS[args.shape]["vocab_size"] // args.vocab_fraction
    first, first_cpu = time_gptq(args.shape, one, vocab)
    print(json.dumps({"shape": args.shape, f"{one}_layers_s": round(first, 1), f"{one}_layers_cpu_s": round(first_cpu, 1)}),
          flush=True)
    second, second_cpu = time_gptq(args.shape, two, vocab)
    layers = CONFIGS[args.shape]["num_hidden_layers"]
    per_layer, per_layer_cpu = (second - first) / (two - one), (second_cpu - first_cpu) / (two - one)
    head, head_cpu = (first - one * per_layer) * args.vocab_fraction, (first_cpu - one * per_layer_cpu) * args.vocab_fraction
    print(json.dumps({"shape": args.shape, "vocab_built": vocab, f"{one}_layers_s": round(first, 1),
                      f"{two}_layers_s": round(second, 1), "per_layer_s": round(per_layer, 1),
                      "per_layer_cpu_s": round(per_layer_cpu, 1), "output_layer_s": round(head, 1),
                      "whole_model_s": round(layers * per_layer + head, 1),
                      "whole_model_cpu_s": round(layers * per_layer_cpu + head_cpu, 1),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}))


if __name__ == "__main__":
    main()
