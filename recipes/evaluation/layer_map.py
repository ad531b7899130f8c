"""The per-layer error map of a recipe (`fidelity.layers`): each decoder layer's output on the evaluation
text against fp32 eager's, as SQNR (dB) and relative error, on the engine that ran the recipe. The outputs come
from recipes/pipeline/layer_outputs.py: the lowered program's taps on the runtime, or eager hooks."""
from __future__ import annotations

import torch

from quant.layer_error import layer_errors
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


def layer_map(engine: str, method: str, reference: list[torch.Tensor], outputs: list[torch.Tensor]) -> LayerMap:
    """fidelity.layers: the engine, how its layer outputs were read, and each layer's error against the
    reference's."""
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
