"""PT2E for a program of several methods that are one module at different static shapes (a prefill of N tokens per
call and a one-token decode): every method's graph is annotated and observed, the calibration runs through one of
them, and the others take its observers' state before convert_pt2e. The graphs are the same ops in the same order,
so every method gets the same encodings and the same integer weights: a backend may then store the weights once."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from models import torch_export
from quant.pt2e import ANNOTATION, _forget_cached_modules, drop_unused_state


def _observers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """What prepare_pt2e inserted (observers of every kind, the affine ones included), by every name it gave them
    (a shared observer has several; named_children would list it once)."""
    return {name: child for name, child in module._modules.items() if name.startswith("activation_post_process_")}


def share_observers(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """target's observers become source's own (their ranges, and what some keep outside their state dict, e.g. a
    block observer's input dtype; convert_pt2e only reads them): the same names, the same kinds, or an error."""
    theirs, ours = _observers(source), _observers(target)
    if set(theirs) != set(ours) or any(type(theirs[n]) is not type(ours[n]) for n in theirs):
        raise RuntimeError("the methods' graphs differ in their observers; they cannot share one calibration")
    for name in ours:
        setattr(target, name, theirs[name])


def quantize_pt2e_methods(programs: dict[str, torch.export.ExportedProgram], quantizer_for: Callable,
                          calibrate: Callable[[torch.nn.Module], None], calibrated: str):
    """({method: quantized ExportedProgram to lower}, {method: converted module that simulates it}).

    quantizer_for(module) -> the quantizer annotating `module`; calibrate(prepared) runs the calibration calls
    through the prepared module of method `calibrated`."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    examples = {name: program.example_inputs[0] for name, program in programs.items()}
    try:
        prepared = {}
        for name, program in programs.items():
            module = program.module()
            prepared[name] = prepare_pt2e(module, quantizer_for(module))
        with torch.no_grad():
            calibrate(prepared[calibrated])
        for name, module in prepared.items():
            if name != calibrated:
                share_observers(prepared[calibrated], module)
        converted = {name: convert_pt2e(module) for name, module in prepared.items()}
    finally:
        _forget_cached_modules()
    del prepared
    quantized = {}
    for name, module in converted.items():
        drop_unused_state(module)
        quantized[name] = torch_export.export(module, examples[name], strict=True)
    return quantized, converted


def share_kv_io_encoding(gm: torch.fx.GraphModule) -> None:
    """One min/max encoding per KV cache given as an input (models/kv_io_llama.py): the cache input, this call's
    new rows (an output the caller appends to that cache) and their concatenation. A moving-average observer,
    started by a first calibration call on an empty cache, keeps a range near zero and clamps every cached
    value a later call reads back; the new rows in another encoding than the cache would change on the way in.
    A custom annotation: run after the quantizer's own. No-op on a graph without cache inputs."""
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    for cache in [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("caches")]:
        joins = [u for u in cache.users if u.target == torch.ops.aten.cat.default and ANNOTATION in u.meta]
        if len(joins) != 1:
            raise RuntimeError(f"unexpected KV cache input form around {cache.name}: users {list(cache.users)}")
        join = joins[0]
        new_rows = join.args[0][1]
        spec = join.meta[ANNOTATION].input_qspec_map[cache]
        if ANNOTATION not in new_rows.meta:
            raise RuntimeError(f"the new rows joined to {cache.name} ({new_rows.name}) are not quantized")
        observer = MinMaxObserver.with_args(dtype=spec.dtype, quant_min=spec.quant_min, quant_max=spec.quant_max,
                                            qscheme=spec.qscheme)
        # the new rows come first in the graph: the cache and the join share their observer
        new_rows.meta[ANNOTATION].output_qspec = dataclasses.replace(spec, observer_or_fake_quant_ctr=observer)
        shared = SharedQuantizationSpec(new_rows)
        annotation = join.meta[ANNOTATION]
        for edge in annotation.input_qspec_map:
            annotation.input_qspec_map[edge] = shared
        annotation.output_qspec = shared
