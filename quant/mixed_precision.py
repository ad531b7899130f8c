"""Mixed precision chosen from measurement. The units are the linears: each of every decoder layer's, and the
output layer. Each is scored by what keeping it alone at 8da8w, in the otherwise all-int4 model, takes off the
model's KL divergence from fp32 on the calibration text; the units that gain the most per extra weight byte per
token are kept at 8da8w, as many as fit in the budget. A linear, not a whole decoder layer, is the unit because
the gain is uneven inside a layer: an attention projection can gain as much as an MLP projection of several times
its bytes. A unit is scored by running only its decoder layer and those after it, on the hidden state the
all-int4 model recorded entering that layer: nothing before the unit changes with it.

The logits, not the layer outputs, are the measure: a few large residual channels dominate the layer outputs'
SQNR, and the output layer, whose error reaches the logits directly, has no layer output to score it by."""
from __future__ import annotations

import copy
from typing import Callable

import torch

OUTPUT_UNIT = "lm_head"


def weight_bytes(weight: torch.Tensor) -> int:
    """Bytes a linear's weight takes in an XNNPACK program: int4 groups with a bf16 scale each, int8 rows with
    an fp32 scale each, or the float tensor itself."""
    if type(weight).__name__ == "IntxUnpackedToInt8Tensor":
        bits = int(str(weight.target_dtype).removeprefix("torch.int"))
        per_channel = weight.block_size[-1] == weight.shape[-1]
        return weight.numel() * bits // 8 + weight.scale.numel() * (4 if per_channel else 2)
    return weight.numel() * weight.element_size()


def linear_weight_bytes(module: torch.nn.Module, units: tuple[str, ...] | None = None) -> int:
    """Weight bytes of the linears (of `units` only, when given): what a decode step reads (an embedding reads
    one row)."""
    return sum(weight_bytes(m.weight) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear) and (units is None or in_units(name, units)))


def mixed_units(module: torch.nn.Module) -> list[str]:
    """The units mixed precision chooses among, by module name: every linear of each decoder layer in turn, then
    the output layer."""
    return [f"model.layers.{i}.{name}" for i, layer in enumerate(module.model.layers)
            for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)] + [OUTPUT_UNIT]


def describe_units(units: list[str]) -> str:
    """e.g. "layer 3 v_proj, down_proj; layer 29 down_proj and the output layer"; a whole decoder layer (a unit
    of reports that chose by layer) reads "layer 4 (all linears)"."""
    by_layer: dict[str, list[str]] = {}
    for unit in units:
        if unit != OUTPUT_UNIT:
            index, _, linear = unit.removeprefix("model.layers.").partition(".")
            by_layer.setdefault(index, []).append(linear.rpartition(".")[2] or "(all linears)")
    parts = ["; ".join(f"layer {index} {', '.join(linears)}" for index, linears in by_layer.items())]
    parts = parts if by_layer else []
    parts += ["the output layer"] if OUTPUT_UNIT in units else []
    return " and ".join(parts)


def in_units(fqn: str, units: tuple[str, ...]) -> bool:
    """Whether the module named `fqn` is one of `units` or inside one."""
    return any(fqn == unit or fqn.startswith(unit + ".") for unit in units)


@torch.no_grad()
def _log_probs(module: torch.nn.Module, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for tokens in windows:
        module.reset_cache()
        out.append(torch.log_softmax(module(tokens, torch.tensor([0]))[0].float(), dim=-1))
    return out


@torch.no_grad()
def _layer_inputs(module: torch.nn.Module, windows: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], tuple]]:
    """Per window: the hidden state entering each decoder layer, then the one leaving the last; and the other
    arguments every layer is called with (rope, positions, mask): the module's forward, layer by layer."""
    out = []
    for tokens in windows:
        module.reset_cache()
        x = module.model.embed_tokens(tokens)
        arguments = module.layer_arguments(tokens.shape[1], torch.tensor([0]), x.dtype)
        states = [x]
        for layer in module.model.layers:
            x = layer(x, *arguments)
            states.append(x)
        out.append((states, arguments))
    return out


@torch.no_grad()
def _log_probs_from(module: torch.nn.Module, first_layer: int, inputs) -> list[torch.Tensor]:
    """The module's log-probabilities, run from decoder layer `first_layer` on (the output layer alone past the
    last) on the hidden states `_layer_inputs` recorded: what comes before a unit does not change with it."""
    out = []
    for states, shared in inputs:
        module.reset_cache()
        x = states[first_layer]
        for layer in module.model.layers[first_layer:]:
            x = layer(x, *shared)
        out.append(torch.log_softmax(module.lm_head(module.model.norm(x))[0].float(), dim=-1))
    return out


def _mean_kl(reference: list[torch.Tensor], log_probs: list[torch.Tensor]) -> float:
    """Mean over positions of KL(fp32 || module)."""
    total = sum((ref.exp() * (ref - log_q)).sum().item() for ref, log_q in zip(reference, log_probs))
    return total / sum(ref.shape[0] for ref in reference)


def unit_layer(unit: str, n_layers: int) -> int:
    """The decoder layer a unit is in; the output layer comes after the last."""
    return n_layers if unit == OUTPUT_UNIT else int(unit.removeprefix("model.layers.").partition(".")[0])


@torch.no_grad()
def choose_8bit_units(module: torch.nn.Module, quantize: Callable[[torch.nn.Module, tuple[str, ...]], None],
                      windows: list[torch.Tensor], budget: float) -> dict:
    """module: the fp32 module about to be quantized (left as it is); quantize(module, units_8bit): the
    scheme, in place, with those units at 8da8w; budget: extra weight bytes per token allowed, as a fraction of
    the all-int4 model's."""
    units = mixed_units(module)
    reference = _log_probs(module, windows)
    trial = copy.deepcopy(module)
    quantize(trial, ())
    eight = copy.deepcopy(module)
    quantize(eight, tuple(units))
    inputs = _layer_inputs(trial, windows)
    # the recorded state leaving the last layer: only the output layer runs again
    int4_kl = _mean_kl(reference, _log_probs_from(trial, len(trial.model.layers), inputs))
    gain, cost = {}, {}
    for unit in units:
        own = trial.get_submodule(unit)
        trial.set_submodule(unit, eight.get_submodule(unit))
        first_layer = unit_layer(unit, len(trial.model.layers))
        gain[unit] = int4_kl - _mean_kl(reference, _log_probs_from(trial, first_layer, inputs))
        trial.set_submodule(unit, own)
        cost[unit] = linear_weight_bytes(eight, (unit,)) - linear_weight_bytes(trial, (unit,))
    base = linear_weight_bytes(trial)
    chosen, spent = [], 0
    for unit in sorted(units, key=lambda u: -gain[u] / cost[u]):
        if gain[unit] > 0 and spent + cost[unit] <= budget * base:
            chosen.append(unit)
            spent += cost[unit]
    chosen.sort(key=units.index)
    return {
        "budget_fraction": budget,
        "units_8bit": chosen,
        "extra_bytes_per_token": spent,
        "int4_bytes_per_token": base,
        "measured_on": "calibration text, eager: mean KL from fp32 of the all-int4 model with one unit at 8da8w",
        "measured_on_tokens": sum(w.shape[1] for w in windows),
        "int4_mean_kl": round(int4_kl, 5),
        "unit_kl_gain": {u: round(gain[u], 5) for u in units},
        "unit_cost_bytes": {u: cost[u] for u in units},
    }
