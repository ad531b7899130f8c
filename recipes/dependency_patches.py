"""Version-guarded speed patches to our dependencies, applied once before lowering. Each changes how fast a
result is computed, never the result: the tests lower the same program with and without them.

1. executorch 1.4.1, XNNPACK preprocessing (executorch.backends.xnnpack._passes.XNNPACKPassManager): for every
   delegated partition, ConvertToUpsampleBilinear2d.call and ConvertToSDPAPass.call run a SubgraphMatcher per
   pattern and then re-trace the partition with fake tensors, even when it cannot contain the pattern (45 % of
   XNNPACK preprocessing on a 2-layer SmolLM2). Skipped when some op of every pattern is absent from the graph:
   a subgraph match needs every op of the pattern, so the pass would have changed nothing.
2. torchao 0.18.0, torchao.quantization.quant_primitives: quantize_affine, dequantize_affine and
   choose_qparams_affine are CompositeImplicitAutograd ops, so every ExportPass re-trace during lowering runs
   their Python bodies (~30 aten ops each) on fake tensors just to learn output shapes: about a third of the
   lowering time of an 8da4w model. For plain fake tensors (no proxy or functional tracing active, i.e. only
   shape propagation) the patch returns empty tensors of the same shape, dtype and strides; real tensors and
   tracing take the original bodies.
"""
from __future__ import annotations

import functools
import importlib.metadata

PATCHED = {"executorch": "1.4.1", "torchao": "0.18.0"}
_applied: set[str] = set()
_torchao_library = None  # the torch.library fragment holding our kernels must stay alive


def _version_matches(package: str) -> bool:
    return importlib.metadata.version(package) == PATCHED[package]


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

    pass_cls.call = call


def _patch_xnnpack_passes() -> None:
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import ConvertToUpsampleBilinear2d
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    _skip_without_pattern(ConvertToSDPAPass, sdpa.get_graphs)
    _skip_without_pattern(ConvertToUpsampleBilinear2d, lambda: list(bilinear_2d.get_graphs_dict()))


def shape_only(tensor) -> bool:
    """A fake tensor outside any tracing: the caller only wants the output's metadata."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    return (
        isinstance(tensor, FakeTensor)
        and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None
        and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is None
    )


def torchao_shape_kernels():
    """Kernels for the three torchao ops: metadata only for shape_only inputs, the original body otherwise."""
    import torch
    from torch._inductor.decomposition import decompositions
    from torchao.quantization.quant_primitives import _get_reduction_params

    ops = torch.ops.torchao
    original = {name: decompositions[getattr(ops, name).default]
                for name in ("quantize_affine", "dequantize_affine", "choose_qparams_affine")}

    def quantize_affine(input, block_size, scale, zero_point, output_dtype, quant_min=None, quant_max=None):
        if shape_only(input):
            return torch.empty_like(input, dtype=output_dtype, memory_format=torch.contiguous_format)
        return original["quantize_affine"](input, block_size, scale, zero_point, output_dtype, quant_min, quant_max)

    def dequantize_affine(input, block_size, scale, zero_point, input_dtype, quant_min=None, quant_max=None,
                          output_dtype=torch.float32):
        if shape_only(input):
            return torch.empty_like(input, dtype=output_dtype, memory_format=torch.contiguous_format)
        return original["dequantize_affine"](input, block_size, scale, zero_point, input_dtype, quant_min, quant_max,
                                             output_dtype)

    def choose_qparams_affine(input, mapping_type, block_size, target_dtype, quant_min=None, quant_max=None,
                              eps=None, scale_dtype=None, zero_point_dtype=None, keepdim=False):
        if shape_only(input):
            if keepdim:
                shape = [input.size(i) // block_size[i] for i in range(len(block_size))]
            else:
                reduced, dims = _get_reduction_params(block_size, input.size())
                shape = [d for i, d in enumerate(reduced) if i not in dims]
            # As in torchao: the asymmetric zero point defaults to int32, the symmetric one keeps the float dtype.
            zero_dtype = zero_point_dtype or (torch.int32 if mapping_type == "ASYMMETRIC" else input.dtype)
            return input.new_empty(shape, dtype=scale_dtype or input.dtype), input.new_empty(shape, dtype=zero_dtype)
        return original["choose_qparams_affine"](input, mapping_type, block_size, target_dtype, quant_min, quant_max,
                                                 eps, scale_dtype, zero_point_dtype, keepdim)

    return original, {"quantize_affine": quantize_affine, "dequantize_affine": dequantize_affine,
                      "choose_qparams_affine": choose_qparams_affine}


def _patch_torchao_shape_propagation() -> None:
    import warnings

    import torch

    global _torchao_library
    _original, kernels = torchao_shape_kernels()
    _torchao_library = torch.library.Library("torchao", "FRAGMENT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        for name, kernel in kernels.items():
            _torchao_library.impl(name, kernel, "CompositeImplicitAutograd")


def apply() -> set[str]:
    """Applies the patches whose package is at the patched version; returns which are in place."""
    if "executorch" not in _applied and _version_matches("executorch"):
        _patch_xnnpack_passes()
        _applied.add("executorch")
    if "torchao" not in _applied and _version_matches("torchao"):
        _patch_torchao_shape_propagation()
        _applied.add("torchao")
    return set(_applied)
