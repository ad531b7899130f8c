"""Where quantization error enters a Llama: each decoder layer's output against the same layer's output in
fp32, as SQNR (dB) and relative error. Eager forward hooks give the layer outputs of any module of
models/llama.py; recipes/evaluation/layer_map.py gets the same tensors from a .pte on the runtime."""
from __future__ import annotations

import math

import torch


def sqnr_db(reference: torch.Tensor, value: torch.Tensor) -> float:
    """10 log10(signal power / error power); inf when they are equal."""
    reference, value = reference.double(), value.double()
    noise = (reference - value).pow(2).sum().item()
    signal = reference.pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def relative_error(reference: torch.Tensor, value: torch.Tensor) -> float:
    reference, value = reference.double(), value.double()
    return (reference - value).norm().item() / max(reference.norm().item(), 1e-30)


def in_reference_basis(module, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Layer outputs of a module whose residual stream was rotated (SpinQuant's R1), rotated back."""
    rotation = getattr(module, "residual_rotation", None)
    return outputs if rotation is None else [x @ rotation.T for x in outputs]


@torch.no_grad()
def eager_layer_outputs(module, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per decoder layer, its output [positions, hidden] (fp32) over all windows, each run from position 0."""
    layers = list(module.model.layers)
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.register_forward_hook(lambda m, args, out, i=i: captured[i].append(out[0].float().clone()))
             for i, layer in enumerate(layers)]
    try:
        for tokens in windows:
            if hasattr(module, "reset_cache"):
                module.reset_cache()
            module(tokens, torch.tensor([0]))
    finally:
        for hook in hooks:
            hook.remove()
    return in_reference_basis(module, [torch.cat(chunks) for chunks in captured])


def layer_errors(reference: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[dict]:
    """[{layer, sqnr_db, relative_error}] per decoder layer (SQNR rounded; inf written as None)."""
    rows = []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        sqnr = sqnr_db(ref, out)
        rows.append({"layer": i, "sqnr_db": None if math.isinf(sqnr) else round(sqnr, 2),
                     "relative_error": float(f"{relative_error(ref, out):.4g}")})
    return rows
