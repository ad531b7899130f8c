"""The speed patch to XNNPACK's preprocessing passes skips only passes that could not have matched."""
import copy

import torch

from recipes import executorch_patches


def _edge_graph(module, *inputs):
    from executorch.exir import to_edge

    return to_edge(torch.export.export(module, inputs)).exported_program()


def test_patch_applies_to_the_pinned_executorch():
    assert executorch_patches.apply() is True


def test_sdpa_pass_still_rewrites_an_sdpa_pattern_and_skips_a_graph_without_one():
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack.partition.graphs import sdpa

    executorch_patches.apply()
    pattern = copy.deepcopy(sdpa.get_graphs()[0])
    result = ConvertToSDPAPass(None)(pattern)
    targets = {str(n.target) for n in result.graph_module.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product_attention" in t for t in targets)

    class Linear(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.relu(x) * 2

    program = _edge_graph(Linear(), torch.randn(2, 4))
    before = [n.target for n in program.graph_module.graph.nodes]
    result = ConvertToSDPAPass(program)(program.graph_module)
    assert result.modified is False
    assert [n.target for n in result.graph_module.graph.nodes] == before
