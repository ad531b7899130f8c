"""Mixed precision chosen from measurement: the decoder layers whose int4 linears add the most error (by the
per-layer map on the calibration text) keep 8da8w linears, as many as fit in a budget of extra weight bytes
per token."""
from __future__ import annotations

import copy
from typing import Callable

import torch

from quant.layer_error import eager_layer_outputs, layer_errors


def weight_bytes(weight: torch.Tensor) -> int:
    """Bytes a linear's weight takes in an XNNPACK program: int4 groups with a bf16 scale each, int8 rows with
    an fp32 scale each, or the float tensor itself."""
    if type(weight).__name__ == "IntxUnpackedToInt8Tensor":
        bits = int(str(weight.target_dtype).removeprefix("torch.int"))
        per_channel = weight.block_size[-1] == weight.shape[-1]
        return weight.numel() * bits // 8 + weight.scale.numel() * (4 if per_channel else 2)
    return weight.numel() * weight.element_size()


def int8_weight_bytes(weight: torch.Tensor) -> int:
    return weight.numel() + weight.shape[0] * 4


def linear_weight_bytes(module: torch.nn.Module, prefix: str = "") -> int:
    """Weight bytes of the linears under `prefix`: what a decode step reads (an embedding reads one row)."""
    return sum(weight_bytes(m.weight) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith(prefix))


def _upgrade_cost(module: torch.nn.Module, layer: int) -> int:
    prefix = f"model.layers.{layer}."
    return sum(int8_weight_bytes(m.weight) - weight_bytes(m.weight) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith(prefix))


def added_noise(errors: list[dict]) -> list[float]:
    """Noise-to-signal power each layer adds to its input's: the drop of SQNR, in linear terms."""
    ratios = [0.0 if e["sqnr_db"] is None else 10 ** (-e["sqnr_db"] / 10) for e in errors]
    return [ratio - (ratios[i - 1] if i else 0.0) for i, ratio in enumerate(ratios)]


@torch.no_grad()
def choose_8bit_layers(module: torch.nn.Module, quantize: Callable[[torch.nn.Module], None],
                       windows: list[torch.Tensor], budget: float) -> dict:
    """module: the fp32 module about to be quantized (left as it is); quantize: the all-int4 scheme, in place;
    budget: extra weight bytes per token allowed, as a fraction of the all-int4 model's."""
    reference = eager_layer_outputs(module, windows)
    trial = copy.deepcopy(module)
    quantize(trial)
    errors = layer_errors(reference, eager_layer_outputs(trial, windows))
    base = linear_weight_bytes(trial)
    noise = added_noise(errors)
    chosen, spent = [], 0
    for layer in sorted(range(len(noise)), key=lambda i: -noise[i]):
        cost = _upgrade_cost(trial, layer)
        if spent + cost <= budget * base:
            chosen.append(layer)
            spent += cost
    return {
        "budget_fraction": budget,
        "layers_8bit": sorted(chosen),
        "extra_bytes_per_token": spent,
        "int4_bytes_per_token": base,
        "measured_on": "calibration text, eager-quantized layer outputs against fp32 eager",
        "layer_cost_bytes": {i: _upgrade_cost(trial, i) for i in sorted(chosen)},
        "int4_layer_sqnr_db": [e["sqnr_db"] for e in errors],
    }
