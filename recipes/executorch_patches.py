"""Version-guarded speed patches to ExecuTorch, applied once before lowering.

executorch 1.4.1, XNNPACK preprocess (executorch.backends.xnnpack._passes.XNNPACKPassManager): for every
delegated partition, ConvertToUpsampleBilinear2d.call and ConvertToSDPAPass.call run a SubgraphMatcher per
pattern over the partition and then re-trace it with fake tensors, even when the partition cannot contain
the pattern. On the built-in model they were ~45 % of XNNPACK preprocessing. The patch skips a pass when
some op of every pattern is absent from the graph: a subgraph match needs every op of the pattern, so a
skipped pass would have changed nothing.
"""
from __future__ import annotations

import functools
import importlib.metadata

PATCHED_EXECUTORCH = "1.4.1"
_applied = False


def _pattern_ops(patterns) -> list[set]:
    return [{n.target for n in p.graph.nodes if n.op == "call_function"} for p in patterns]


def _skip_without_pattern(pass_cls, patterns_of):
    from torch.fx.passes.infra.pass_base import PassResult

    original = pass_cls.call

    @functools.wraps(original)
    def call(self, graph_module):
        present = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
        if not any(ops <= present for ops in _pattern_ops(patterns_of())):
            return PassResult(graph_module, False)
        return original(self, graph_module)

    call.lowerbench_original = original
    pass_cls.call = call


def apply() -> bool:
    """Returns whether the patches are in place (only on the ExecuTorch version they were written for)."""
    global _applied
    if _applied:
        return True
    if importlib.metadata.version("executorch") != PATCHED_EXECUTORCH:
        return False
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import ConvertToUpsampleBilinear2d
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    _skip_without_pattern(ConvertToSDPAPass, sdpa.get_graphs)
    _skip_without_pattern(ConvertToUpsampleBilinear2d, lambda: list(bilinear_2d.get_graphs_dict()))
    _applied = True
    return True
