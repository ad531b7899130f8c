"""The per-layer error map of a recipe (`fidelity.layers`): each decoder layer's output on the evaluation
text against fp32 eager's, as SQNR (dB) and relative error, on the engine that ran the recipe. Where the
.pte runs here, ExecuTorch's intermediate-output tap makes the lowered program return every layer's output
as an extra output (inside the XNNPACK delegate too): the recipe's quantized program is exported again,
tapped, lowered with the recipe's partitioners and run on the runtime. Otherwise eager forward hooks on the
quantized (or simulated) module give the same tensors, labelled with the eager engine."""
from __future__ import annotations

import torch

from quant.layer_error import eager_layer_outputs, in_reference_basis, layer_errors
from recipes.running.generate import load_runtime_method
from recipes.lowering.lower import Lowering, export_program, lower_for_backend
from recipes.output.report import LayerError, LayerMap, Report


def windows_of(ids: list[int], max_seq_len: int) -> list[torch.Tensor]:
    """The windows recipes/evaluation/fidelity.py scores, as token tensors [1, T]."""
    return [torch.tensor([ids[i:i + max_seq_len]], dtype=torch.long) for i in range(0, len(ids), max_seq_len)
            if len(ids[i:i + max_seq_len]) > 1]


def decoder_layer_outputs(program: torch.export.ExportedProgram) -> list[str]:
    """Names of the nodes that make each decoder layer's output (its second residual add), in layer order."""
    last: dict[str, str] = {}
    for node in program.graph.nodes:
        stack = node.meta.get("nn_module_stack") if node.op == "call_function" else None
        if not stack:
            continue
        path, owner = list(stack.values())[-1]
        if getattr(owner, "__name__", str(owner)).rsplit(".", 1)[-1].rstrip("'>") == "DecoderLayer":
            last[path] = node.name
    return list(last.values())


def runtime_layer_outputs(module, recipe, options: dict, windows: list[torch.Tensor], max_seq_len: int):
    from executorch.devtools.intermediate_output_tap import FULL_TENSOR, strip_taps_, tap_intermediate_outputs_

    backend = recipe.backend
    program = export_program(module, max_seq_len, strict=backend.strict_export)
    names = set(decoder_layer_outputs(program))
    program, specs = tap_intermediate_outputs_(program, (lambda node: node.name in names, FULL_TENSOR))
    lowered = lower_for_backend(program, recipe, options, Lowering(before_serialize=strip_taps_))
    _program, method = load_runtime_method(lowered.pte, backend.runtime_imports)
    captured: list[list[torch.Tensor]] = [[] for _ in specs]
    for tokens in windows:
        outputs = method.execute([tokens, torch.tensor([0], dtype=torch.long)])
        for i, spec in enumerate(specs):
            captured[i].append(outputs[spec.output_index][0].float().clone())
    return in_reference_basis(module, [torch.cat(chunks) for chunks in captured])


def layer_map(engine: str, module, recipe, options: dict, reference: list[torch.Tensor],
              windows: list[torch.Tensor], max_seq_len: int, on_runtime: bool) -> LayerMap:
    """fidelity.layers: the engine, how the outputs were read, and each decoder layer's error."""
    if on_runtime:
        outputs = runtime_layer_outputs(module, recipe, options, windows, max_seq_len)
        method = "ExecuTorch intermediate_output_tap on the lowered program, run on the runtime"
    elif not hasattr(module, "model"):
        raise ValueError("no per-layer map of a PT2E-converted graph: its decoder layers are no longer modules")
    else:
        outputs = eager_layer_outputs(module, windows)
        method = "eager forward hooks on the quantized module"
    return LayerMap(engine=engine, method=method,
                    layers=[LayerError.from_dict(row, strict=True) for row in layer_errors(reference, outputs)])


def sqnr_chart_rows(reports: list[Report]) -> list[dict]:
    """Long-form rows {recipe, layer, sqnr_db} for a line chart of SQNR per layer, one line per recipe
    (the app's gr.LinePlot takes these as a table)."""
    rows = []
    for report in reports:
        found = report.fidelity.layers if report.fidelity else None
        rows += [{"recipe": report.recipe.name, "layer": row.layer, "sqnr_db": row.sqnr_db}
                 for row in (found.layers if found else []) if row.sqnr_db is not None]
    return rows
