"""torch.export.export, without the copy of the traced module strict export leaves behind.

Strict export traces with Dynamo, which installs each traced graph as a global (`__compiled_fn_<n>_<uuid>`) of the
module whose frame it compiled, a function of torch's own export wrapper. That graph holds every parameter and
buffer of the module it traced, and nothing ever deletes it: each strict export kept its module's weights alive
for the rest of the process, so a float model stayed in memory after it was quantized, lowered and dropped. The
exported program does not need that graph, so it is deleted once the export returns.
"""
from __future__ import annotations

import sys

import torch

COMPILED_GRAPH_PREFIX = "__compiled_fn"  # torch._dynamo.output_graph's name for the globals it installs


def _compiled_graph_globals() -> set[tuple[str, str]]:
    return {(module_name, name) for module_name, module in list(sys.modules.items())
            for name in list(getattr(module, "__dict__", {})) if name.startswith(COMPILED_GRAPH_PREFIX)}


def export(module: torch.nn.Module, example: tuple, dynamic_shapes=None, strict: bool = True
           ) -> torch.export.ExportedProgram:
    before = _compiled_graph_globals()
    try:
        with torch.no_grad():
            return torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=strict)
    finally:
        for module_name, name in _compiled_graph_globals() - before:
            vars(sys.modules[module_name]).pop(name, None)
