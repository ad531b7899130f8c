"""XNNPACK: ExecuTorch's CPU backend. The .pte runs here, on the ExecuTorch runtime.

Its module form: ExecuTorch's llama::update_cache + llama::custom_sdpa (they attend only to the filled part
of the cache, outside the delegate), q/k/v fused into one linear, and the norms' mean of squares as a linear
(XNNPACK's mean is a global average pooling that takes only 4-D channels-last input, so it would come with
two layout changes per norm and split every layer). Its lowering runs with the speed patches below,
entered around its lowering only: they target XNNPACK's passes and its lowering path, and are checked (same
bytes or same logits) on it alone.

The speed patches are version-guarded and active only while an XNNPACK lowering runs: `patched()` is the
backend's lowering_context, entered around to_edge_transform_and_lower and
to_executorch and restoring every original on exit, so no other backend's lowering ever meets them. Each
targets one version (PATCHED) and does nothing on another.

1. executorch 1.5.1, XNNPACK preprocessing (executorch.backends.xnnpack._passes.XNNPACKPassManager): for every
   delegated partition, ConvertToUpsampleBilinear2d.call and ConvertToSDPAPass.call run a SubgraphMatcher per
   pattern and then re-trace the partition with fake tensors, even when it cannot contain the pattern. Skipped
   when some op of every pattern is absent from the graph: a subgraph match needs every op of the pattern, so
   the pass would have changed nothing.
2. torchao 0.18.0, torchao.quantization.quant_primitives: quantize_affine, dequantize_affine and
   choose_qparams_affine are CompositeImplicitAutograd ops, so every ExportPass re-trace during lowering runs
   their Python bodies (~30 aten ops each) on fake tensors just to learn output shapes. For plain fake tensors
   (no proxy or functional tracing active, i.e. only shape propagation) the patch returns empty tensors of the
   same shape, dtype and strides; real tensors and tracing take the original bodies.
3. executorch 1.5.1, XNNPACK preprocessing again: most passes of XNNPACKPassManager rewrite the partition's graph
   in place in their call() and then call ExportPass.call (executorch.exir.pass_base._ExportPassBase.call) "to
   regenerate metadata", a full re-trace with fake tensors, whether or not they changed anything. For the
   passes listed in RETRACE_ONLY_AFTER_CHANGE the re-trace is skipped when the graph is, node for node, the one
   the pass received: re-tracing an unchanged graph gives it back unchanged.
4. executorch 1.5.1, partition creation (executorch.exir.backend.backend_api._create_partitions_in_graph_module
   -> executorch.exir.lowered_backend_module.create_submodule_from_nodes): after cutting each partition out, it
   rebuilds the whole top-level graph in topological order (torch.fx legalize_graph), once per partition --
   quadratic in depth. The patch checks the order in one read-only sweep and re-sorts only when a node
   really comes before one of its inputs.
5. executorch 1.5.1, lowering every partition (executorch.exir.backend.backend_api.lower_all_submodules_to_backend):
   each partition's program is deep-copied before preprocessing (BackendDetails.copy_exported_program_for_preprocess),
   its weights included, and all copies exist at once: a second copy of every delegated weight, the largest share
   of a big model's lowering peak. XNNPACK's preprocessing reads those tensors and never writes them (it
   serializes them or builds new ones), so the copy shares their storage and still copies the graph and the
   state-dict mappings, as ExecuTorch's CUDA backend does in its low-memory mode.

Patches 1-3 and 5 leave the .pte byte for byte as it is without them. Patch 4 is the one that changes its bytes:
legalize_graph re-sorts an already valid order too, so without it the top-level nodes (delegate calls and
the ops between them) come out in another topological order. Any topological order computes the same
values: every instruction still runs after its inputs, the delegates' payloads are the same bytes, and the
tests check that the runtime's logits are bit-identical with and without it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
from contextlib import contextmanager
from typing import Callable

from models.errors import UserFacingError
from models.module_options import KV_CACHE_DTYPES
from quant.schemes import SCHEMES
from recipes.lowering.lower import share_preprocess_weights, spill_named_data, swap_attribute
from recipes.registry import Backend, recipe

PATCHED = {"executorch": "1.5.1", "torchao": "0.18.0"}


def _version_matches(package: str) -> bool:
    return importlib.metadata.version(package) == PATCHED[package]


def _pattern_ops(patterns) -> list[set]:
    return [{n.target for n in p.graph.nodes if n.op == "call_function"} for p in patterns]


def _skip_without_pattern(pass_cls, patterns_of, anchor_of):
    """Skip the pass when some op of every pattern is absent. `anchor_of()` names an op that every
    pattern contains (a test checks it): without it in the graph, the patterns themselves, which take
    seconds to build (each is exported on every call), are never needed."""
    from torch.fx.passes.infra.pass_base import PassResult

    original = pass_cls.call
    pattern_ops = functools.cache(lambda: _pattern_ops(patterns_of()))

    @functools.wraps(original)
    def call(self, graph_module):
        present = {n.target for n in graph_module.graph.nodes if n.op == "call_function"}
        if anchor_of() not in present or not any(ops <= present for ops in pattern_ops()):
            return PassResult(graph_module, False)
        return original(self, graph_module)

    return swap_attribute(pass_cls, "call", call)


def pass_patterns():
    """{pass class: (patterns_of, anchor_of)} for the XNNPACK passes patch 1 guards."""
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack._passes.convert_to_upsample_bilinear2d import ConvertToUpsampleBilinear2d
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa
    from executorch.exir.dialects._ops import ops as exir_ops

    return {
        ConvertToSDPAPass: (sdpa.get_graphs, lambda: exir_ops.edge.aten._softmax.default),
        ConvertToUpsampleBilinear2d: (lambda: list(bilinear_2d.get_graphs_dict()),
                                      lambda: exir_ops.edge.aten.upsample_bilinear2d.vec),
    }


def _patch_xnnpack_passes() -> list[Callable[[], None]]:
    return [_skip_without_pattern(pass_cls, patterns_of, anchor_of)
            for pass_cls, (patterns_of, anchor_of) in pass_patterns().items()]


# XNNPACK passes whose whole rewrite happens in call() before the closing super().call() re-trace: none of them
# overrides the per-node hooks (call_operator, placeholder, output) that do work during a re-trace, which
# _patch_idle_retraces checks before patching.
RETRACE_ONLY_AFTER_CHANGE = (
    "executorch.backends.xnnpack._passes.convert_to_linear.ConvertToLinearPass",
    "executorch.backends.xnnpack._passes.propagate_custom_meta_pass.PropagateCustomMetaPass",
    "executorch.backends.xnnpack._passes.fuse_batch_norm.FuseBatchNormPass",
    "executorch.backends.xnnpack._passes.decompose_batch_norm.DecomposeBatchNorm",
    "executorch.backends.xnnpack._passes.fuse_activation_pass.FuseActivationPass",
    "executorch.backends.xnnpack._passes.decompose_cat.DecomposeConcatenate",
    "executorch.backends.transforms.remove_getitem_op.RemoveGetItemPass",
    "executorch.backends.xnnpack._passes.conv1d_unsqueeze_pass.Conv1dUnsqueezePass",
    "executorch.backends.xnnpack._passes.prelu_reshape_pass.PReLUReshapePass",
    "executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass.ChannelsLastTaggedReshapePass",
    "executorch.backends.xnnpack._passes.remove_redundant_copy_pass.RemoveRedundantCopyPass",
)
_RETRACE_HOOKS = ("call_operator", "placeholder", "output", "call_submodule", "call_getitem", "call_cond",
                  "call_map", "call_sym")


def graph_fingerprint(graph_module) -> tuple:
    """Every node's name, kind, target and arguments (other nodes by name): equal fingerprints, same graph."""
    from torch.fx.node import map_arg

    return tuple(
        (n.name, n.op, str(n.target), repr(map_arg(n.args, lambda a: a.name)),
         repr(map_arg(n.kwargs, lambda a: a.name)))
        for n in graph_module.graph.nodes
    )


def retrace_only_after_change_classes() -> list[type]:
    classes = []
    for path in RETRACE_ONLY_AFTER_CHANGE:
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        overridden = [hook for hook in _RETRACE_HOOKS
                      if any(hook in vars(k) for k in cls.__mro__ if k.__module__.startswith("executorch.backends"))]
        if overridden:
            raise RuntimeError(f"{path} overrides {overridden}: its re-trace does work, it must not be skipped")
        classes.append(cls)
    return classes


def _patch_idle_retraces() -> list[Callable[[], None]]:
    from executorch.exir.pass_base import _ExportPassBase
    from torch.fx.passes.infra.pass_base import PassResult

    restores = []
    for cls in retrace_only_after_change_classes():
        original_call = cls.call

        @functools.wraps(original_call)
        def call(self, graph_module, _original=original_call, _cls=cls):
            if type(self) is not _cls:
                # A subclass (e.g. Arm's RemoveGetItemPass) was not checked for hooks and may rewrite the graph
                # before calling this call(): its closing re-trace always runs.
                return _original(self, graph_module)
            self._lowerbench_received = graph_fingerprint(graph_module)
            try:
                return _original(self, graph_module)
            finally:
                del self._lowerbench_received

        restores.append(swap_attribute(cls, "call", call))

    retrace = _ExportPassBase.call

    @functools.wraps(retrace)
    def call_unless_unchanged(self, graph_module):
        received = getattr(self, "_lowerbench_received", None)
        if received is not None and graph_fingerprint(graph_module) == received:
            return PassResult(graph_module, False)
        return retrace(self, graph_module)

    restores.append(swap_attribute(_ExportPassBase, "call", call_unless_unchanged))
    return restores


def topologically_ordered(graph) -> bool:
    seen = set()
    for node in graph.nodes:
        if any(arg not in seen for arg in node.all_input_nodes):
            return False
        seen.add(node)
    return True


def _patch_partition_legalize() -> list[Callable[[], None]]:
    from executorch.exir.backend import backend_api
    from torch.fx.passes.tools_common import legalize_graph

    original = backend_api.create_submodule_from_nodes

    @functools.wraps(original)
    def create_submodule_from_nodes(gm, node_list, tag, skip_legalize_graph=False):
        submodule, call_node = original(gm, node_list, tag, skip_legalize_graph=True)
        if not skip_legalize_graph and not topologically_ordered(gm.graph):
            legalize_graph(gm)  # a new graph: look the call node up again, as the original does
            call_node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == call_node.target)
        return submodule, call_node

    return [swap_attribute(backend_api, "create_submodule_from_nodes", create_submodule_from_nodes)]


def _patch_shared_preprocess_weights() -> list[Callable[[], None]]:
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    return [share_preprocess_weights(XnnpackBackend)]


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


def _patch_torchao_shape_propagation() -> list[Callable[[], None]]:
    import warnings

    import torch

    _original, kernels = torchao_shape_kernels()
    library = torch.library.Library("torchao", "FRAGMENT")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
        for name, kernel in kernels.items():
            library.impl(name, kernel, "CompositeImplicitAutograd")
    # Destroying the fragment deregisters its kernels: the dispatcher falls back to torchao's own.
    return [library._destroy]


@contextmanager
def patched(reorder_partitions: bool = True):
    """The patches whose package is at the patched version, for the duration of the block.
    reorder_partitions=False leaves patch 4 out, the one that changes the .pte's bytes (see above)."""
    restores: list[Callable[[], None]] = []
    try:
        if _version_matches("executorch"):
            restores += _patch_xnnpack_passes()
            restores += _patch_idle_retraces()
            if reorder_partitions:
                restores += _patch_partition_legalize()
            restores += _patch_shared_preprocess_weights()
        if _version_matches("torchao"):
            restores += _patch_torchao_shape_propagation()
        yield
    finally:
        for restore in reversed(restores):
            restore()


@contextmanager
def named_data_files(spill_dir, external_tag):
    """XNNPACK's preprocessing puts every constant it packs (weights, scales) in ExecuTorch's named data store,
    by key; the runtime looks the keys up in the .pte's data and in the .ptd's alike."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    restore = spill_named_data(XnnpackBackend, spill_dir, external_tag)
    try:
        yield
    finally:
        restore()


def patch_targets() -> dict[str, object]:
    """What every patched attribute is right now (the torchao ops by their dispatcher table): equal before
    and after a block, and equal inside one that runs without the patches."""
    import torch
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend
    from executorch.exir.backend import backend_api
    from executorch.exir.pass_base import _ExportPassBase

    targets = {f"{cls.__qualname__}.call": vars(cls).get("call") for cls in pass_patterns()}
    targets.update({f"{cls.__qualname__}.call": vars(cls).get("call") for cls in retrace_only_after_change_classes()})
    targets["_ExportPassBase.call"] = vars(_ExportPassBase)["call"]
    targets["backend_api.create_submodule_from_nodes"] = backend_api.create_submodule_from_nodes
    targets["XnnpackBackend.copy_exported_program_for_preprocess"] = vars(XnnpackBackend).get(
        "copy_exported_program_for_preprocess")
    for name in ("quantize_affine", "dequantize_affine", "choose_qparams_affine"):
        targets[f"torchao::{name}"] = torch._C._dispatch_dump(f"torchao::{name}")
    return targets


# The most tokens one call of an XNNPACK program takes: the runtime plans every activation (the logits
# [tokens, vocab] most of all) for the longest call, so a longer prompt goes in calls of this many tokens.
PREFILL_CHUNK_TOKENS = 512


def kv_cache_defaults(recipe) -> dict:
    """Every XNNPACK recipe takes the KV cache options: caches stored as the module computes (fp32; fp16 for the
    fp16 recipe), and no ring (0)."""
    module_dtype = SCHEMES[recipe.quantization].module_dtype
    return {"kv_cache": next(name for name, dtype in KV_CACHE_DTYPES.items() if dtype == module_dtype),
            "kv_cache_window": 0}


def kv_cache_module_options(options: dict, form: dict) -> dict:
    """kv_cache and kv_cache_window as the module's fields, and the tokens one call takes. A cache kept apart
    from the module's dtype, or a ring, needs ExecuTorch's cache ops: a recipe whose form attends with aten's
    SDPA (fp16) then takes the custom ops' form, computing attention in the cache's float dtype."""
    dtype, window = options.get("kv_cache"), int(options.get("kv_cache_window") or 0) or None
    fields = {"kv_cache_dtype": dtype, "kv_window": window, "tokens_per_call": PREFILL_CHUNK_TOKENS}
    if form["attention"] != "custom" and (window or (dtype and KV_CACHE_DTYPES[dtype] != form["dtype"])):
        fields["attention"] = "custom"
    return fields


def check_kv_cache_options(options: dict) -> None:
    """A KV cache dtype the models know, and a window that is a token count (0: no ring)."""
    dtype, window = options.get("kv_cache"), options.get("kv_cache_window")
    if dtype is not None and dtype not in KV_CACHE_DTYPES:
        raise UserFacingError(f"kv_cache {dtype!r} is not a KV cache dtype; choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}.")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 0):
        raise UserFacingError(f"kv_cache_window {window!r} is not a token count; give the recent tokens to keep, "
                              "e.g. --kv-cache-window 2048 (0 for no ring).")


def xnnpack_partitioners(options: dict) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


WEIGHT_ONLY = ("XNNPACK does not take weight-only linears: the .pte keeps fp32 weights and its logits are wrong; "
               "use {instead} (int{bits} weights, int8 dynamic activations)")

BACKEND = Backend(
    name="xnnpack",
    title="XNNPACK",
    delegate_id="XnnpackBackend",
    runs_on="any CPU with the ExecuTorch runtime: Linux, macOS, Windows, Android, iOS",
    partitioners=xnnpack_partitioners,
    schemes=("fp32", "fp16", "8da4w", "8da4w-emb4", "8da8w"),
    refused={
        "int8-weight": WEIGHT_ONLY.format(instead="8da8w", bits=8),
        "int4-weight": WEIGHT_ONLY.format(instead="8da4w", bits=4),
        "bf16": "not offered: XNNPACK's bf16 support is not checked on this stack; use fp16",
    },
    attention="custom",
    norm="linear-mean",
    fuse_qkv=True,
    # Non-strict export takes a third of strict's time and, for this form, gives the same program
    # (bit-identical logits on the runtime, fp32 and 8da4w).
    strict_export=False,
    option_defaults=kv_cache_defaults,
    module_options=kv_cache_module_options,
    check_options=check_kv_cache_options,
    runtime_imports=(
        "executorch.extension.llm.custom_ops.custom_ops",  # llama::custom_sdpa, llama::update_cache
        # quantized_decomposed::embedding_byte / embedding_4bit, and the int8 KV cache's
        # choose_qparams_per_token_asymmetric / quantize_per_token
        "executorch.kernels.quantized",
    ),
    lowering_context=patched,
    named_data_context=named_data_files,
    # Beside the quantized module: the edge program's constants and the packing of the partitions, whose packed
    # weights go to files as each is packed (named_data_files); the copy of each partition made for
    # preprocessing shares the weights (patch 5 above). Fitted to the zoo's cells from 135M to Llama-3.1-8B's
    # shape: one partition's packing at a time is a smaller share of a bigger program.
    lowering_memory_ratio=0.38,
    lowering_memory_per_layer_bytes=17e6,
    # The flatbuffer and what the lowered program still holds; the packed weights are copied from their files.
    serialize_memory_ratio=0.4,
    # A static recipe's second method: each method's delegate payloads are made in turn, the weights stored once in
    # the named data both reference (measured by bench/static_methods.py: docs/design.md).
    lowering_memory_per_method=0.87,
)

RECIPES = (
    recipe(BACKEND, "fp32", "XNNPACK, fp32 weights"),
    recipe(BACKEND, "8da4w", "XNNPACK, int8 dynamic activations + int4 weights (group 32), 8-bit embeddings",
           options={"group_size": 32}, default=True),
    recipe(BACKEND, "8da4w-emb4", "XNNPACK, int8 dynamic activations + int4 weights (group 32), 4-bit embeddings",
           options={"group_size": 32}),
    recipe(BACKEND, "8da8w", "XNNPACK, int8 dynamic activations + int8 per-channel weights, 8-bit embeddings"),
    # aten SDPA outside the delegate runs fp16 on the portable ops, with q/k/v as three linears, the form this
    # recipe is checked in; another kv_cache or a ring takes the custom ops' form (kv_cache_module_options).
    recipe(BACKEND, "fp16", "XNNPACK, fp16 weights and activations",
           module_overrides={"attention": "sdpa", "fuse_qkv": False}),
    # The Core ML Neural Engine recipes' static form (the same module, methods and IO) in fp32, which runs here:
    # run_static.py drives it on the ExecuTorch runtime exactly as it drives theirs on Apple hardware.
    recipe(BACKEND, "fp32", "XNNPACK twin of the static Neural Engine form: fp32, prefill and decode methods, caches "
                            "as inputs and outputs, run by run_static.py", name="xnnpack-static-fp32",
           options={"prefill_chunk": 32, "max_linear_outputs": 1024},
           module_overrides={"attention": "sdpa-slice", "fuse_qkv": False, "norm": "hf"}, static_io=True),
)
