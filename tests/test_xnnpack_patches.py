"""The XNNPACK lowering's speed patches, and Lowerbench's own skipped decomposition, change how fast the
.pte is made, never what it computes; the patches are in place only while an XNNPACK lowering runs."""
import copy

import torch

from recipes.backends import xnnpack as xnnpack_patches


def _edge_graph(module, *inputs):
    from executorch.exir import to_edge

    return to_edge(torch.export.export(module, inputs)).exported_program()


def test_patches_apply_to_the_pinned_versions_and_are_undone_on_exit():
    before = xnnpack_patches.patch_targets()
    with xnnpack_patches.patched():
        inside = xnnpack_patches.patch_targets()
    assert all(inside[name] != value for name, value in before.items()), \
        [name for name, value in before.items() if inside[name] == value]
    assert xnnpack_patches.patch_targets() == before


def test_each_guarded_pass_anchor_is_in_every_one_of_its_patterns():
    """The patch skips a pass without building its patterns when the anchor op is absent: that is only
    safe while every pattern contains the anchor."""
    for pass_cls, (patterns_of, anchor_of) in xnnpack_patches.pass_patterns().items():
        patterns = xnnpack_patches._pattern_ops(patterns_of())
        assert patterns, pass_cls
        assert all(anchor_of() in ops for ops in patterns), pass_cls


def test_sdpa_pass_still_rewrites_an_sdpa_pattern_and_skips_a_graph_without_one():
    from executorch.backends.xnnpack._passes.convert_to_sdpa import ConvertToSDPAPass
    from executorch.backends.xnnpack.partition.graphs import sdpa

    class Linear(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.relu(x) * 2

    program = _edge_graph(Linear(), torch.randn(2, 4))
    before = [n.target for n in program.graph_module.graph.nodes]
    with xnnpack_patches.patched():
        pattern = copy.deepcopy(sdpa.get_graphs()[0])
        rewritten = ConvertToSDPAPass(None)(pattern)
        result = ConvertToSDPAPass(program)(program.graph_module)
    targets = {str(n.target) for n in rewritten.graph_module.graph.nodes if n.op == "call_function"}
    assert any("scaled_dot_product_attention" in t for t in targets)
    assert result.modified is False
    assert [n.target for n in result.graph_module.graph.nodes] == before


def test_torchao_shape_kernels_give_the_metadata_of_the_originals():
    """On fake tensors, symbolic dims included, every mapping / block / keepdim / dtype combination."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    original, fast = xnnpack_patches.torchao_shape_kernels()

    def meta(t):
        return tuple(t.shape), t.dtype, tuple(t.stride())

    mode = FakeTensorMode(shape_env=ShapeEnv())
    checked = 0
    with mode:
        env = mode.shape_env
        seq = env.create_symintnode(env.create_symbol(7, ConstantSource("seq")), hint=7)
        for x in (torch.empty(1, seq, 64), torch.empty(96, 64)):
            for mapping in ("SYMMETRIC", "ASYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR"):
                for block in ([1] * (x.dim() - 1) + [64], [1] * (x.dim() - 1) + [32]):
                    for keepdim in (False, True):
                        for scale_dtype, zero_dtype in ((None, None), (torch.float32, torch.int8)):
                            args = (x, mapping, block, torch.int8, -128, 127, None, scale_dtype, zero_dtype, keepdim)
                            expected = original["choose_qparams_affine"](*args)
                            assert [meta(t) for t in fast["choose_qparams_affine"](*args)] == [meta(t) for t in expected]
                            scale, zero = expected
                            q = original["quantize_affine"](x, block, scale, zero, torch.int8, -128, 127)
                            assert meta(fast["quantize_affine"](x, block, scale, zero, torch.int8, -128, 127)) == meta(q)
                            dq = (q, block, scale, zero, torch.int8, -128, 127, torch.float32)
                            assert meta(fast["dequantize_affine"](*dq)) == meta(original["dequantize_affine"](*dq))
                            checked += 1
    assert checked == 48


# Lowers the same tiny 8da4w Llama once per mode given, in that order, in one process: the patched modes
# first, since "unpatched" also turns the skipped decomposition back on for the rest of the process.
_LOWER_TINY_8DA4W = r"""
import hashlib, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from models.llama import ExportOptions, build_exportable
from quant.schemes import apply_scheme
from contextlib import nullcontext
from recipes.running import generate
from recipes.lowering import lower as lowering
from recipes.backends.xnnpack import BACKEND, patched, xnnpack_partitioners
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
torch.manual_seed(0)
weights = LlamaForCausalLM(config).state_dict()
for mode in sys.argv[1:]:
    context = BACKEND.lowering_context
    if mode == "unpatched":
        context = nullcontext
        lowering._skip_redundant_decomposition = lambda partitioners: None  # ExecuTorch's three decompositions
    elif mode == "patched-same-order":
        context = lambda: patched(reorder_partitions=False)
    options = ExportOptions(max_seq_len=64, attention=BACKEND.attention, norm=BACKEND.norm, fuse_qkv=BACKEND.fuse_qkv)
    module = build_exportable(config, weights, options)
    apply_scheme(module, "8da4w", algorithm="hqq")
    program = lowering.export_program(module, 64, strict=BACKEND.strict_export)
    lowered = lowering.lower_to_pte(program, xnnpack_partitioners({}), lowering.Lowering(lowering_context=context))
    print(mode, "PTE", hashlib.sha256(lowered.pte).hexdigest())
    loaded, method = generate.load_runtime_method(lowered.pte, BACKEND.runtime_imports)
    prefill = method.execute([torch.tensor([[5, 17, 200, 3, 99, 41]]), torch.tensor([0])])[0]
    decode = method.execute([torch.tensor([[7]]), torch.tensor([6])])[0]
    print(mode, "LOGITS", hashlib.sha256(prefill.numpy().tobytes() + decode.numpy().tobytes()).hexdigest())
"""


def test_patches_change_neither_the_pte_bytes_nor_what_it_computes():
    """Patches 1-3 and the skipped decomposition: byte-identical .pte. Patch 4 reorders top-level
    instructions: bit-identical logits on the ExecuTorch runtime, prefill and decode."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    modes = ("patched", "patched-same-order", "unpatched")
    result = subprocess.run([sys.executable, "-c", _LOWER_TINY_8DA4W, *modes], cwd=root, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    out = {mode: {} for mode in modes}
    for line in result.stdout.splitlines():
        mode, _, rest = line.partition(" ")
        if mode in out and rest.startswith(("PTE", "LOGITS")):
            key, digest = rest.split(" ", 1)
            out[mode][key] = digest
    assert all(len(out[mode]) == 2 for mode in modes), result.stdout[-2000:]
    assert out["patched-same-order"]["PTE"] == out["unpatched"]["PTE"]
    assert out["patched"]["PTE"] != out["unpatched"]["PTE"]  # the reorder is exercised, not a no-op here
    assert out["patched"]["LOGITS"] == out["patched-same-order"]["LOGITS"] == out["unpatched"]["LOGITS"]


def test_idle_retrace_is_skipped_for_the_listed_pass_only_not_for_its_subclasses():
    from executorch.backends.xnnpack._passes.convert_to_linear import ConvertToLinearPass

    class Linear(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.relu(x) * 2

    class Subclass(ConvertToLinearPass):  # e.g. a backend's variant that rewrites before calling super().call
        pass

    graph_module = _edge_graph(Linear(), torch.randn(2, 4)).graph_module
    with xnnpack_patches.patched():
        assert ConvertToLinearPass()(graph_module).graph_module is graph_module  # nothing to convert: no re-trace
        assert Subclass()(graph_module).graph_module is not graph_module  # re-traced, as without the patch
    assert ConvertToLinearPass()(graph_module).graph_module is not graph_module  # outside: re-traced


def test_order_check_finds_a_node_before_its_input():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.relu, (x,))
    graph.output(y)
    assert xnnpack_patches.topologically_ordered(graph)
    x.append(graph.call_function(torch.neg, (y,)))  # neg(y) moved before y
    assert not xnnpack_patches.topologically_ordered(graph)


class _PatchProbe:
    """A transform pass that changes nothing and records what the patched attributes are while the lowering
    runs (transform passes run inside to_edge_transform_and_lower)."""

    def __init__(self):
        self.seen = None

    def __call__(self, graph_module):
        from torch.fx.passes.infra.pass_base import PassResult

        self.seen = xnnpack_patches.patch_targets()
        return PassResult(graph_module, False)


def _lower_tiny(tiny_checkpoint, name: str, probe: _PatchProbe):
    from models.llama import build_exportable
    from recipes.lowering.lower import Lowering, export_program, lower_to_pte
    from recipes.registry import get_recipe

    recipe = get_recipe(name)
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, recipe.export_options(32))
    program = export_program(module, 32, strict=recipe.backend.strict_export)
    return lower_to_pte(program, recipe.make_partitioners(recipe.options),
                        Lowering(transform_passes=[probe], lowering_context=recipe.backend.lowering_context))


def test_xnnpack_lowering_runs_patched_and_leaves_the_originals_behind(tiny_checkpoint):
    originals = xnnpack_patches.patch_targets()
    probe = _PatchProbe()
    _lower_tiny(tiny_checkpoint, "xnnpack-fp32", probe)
    assert all(probe.seen[name] != value for name, value in originals.items())
    assert xnnpack_patches.patch_targets() == originals


def test_non_xnnpack_lowering_runs_with_no_patch_active(tiny_checkpoint):
    originals = xnnpack_patches.patch_targets()
    probe = _PatchProbe()
    lowered = _lower_tiny(tiny_checkpoint, "coreml-fp32", probe)
    assert lowered.delegation.delegated_subgraphs >= 1
    assert probe.seen == originals


def test_preprocess_copy_shares_the_weights_and_copies_the_graph_only_while_patched():
    """The per-partition copy made before XNNPACK's preprocessing: a second copy of every weight without the
    patch, the same tensors with it; the graph and the state-dict mapping are the copy's own either way."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    program = _edge_graph(torch.nn.Linear(64, 32), torch.randn(2, 64))
    weights = dict(program.state_dict)

    def copied():
        copy_ = XnnpackBackend.copy_exported_program_for_preprocess(program, [])
        assert copy_.graph_module is not program.graph_module and copy_.state_dict is not program.state_dict
        assert all(torch.equal(copy_.state_dict[name], tensor) for name, tensor in weights.items())
        return [copy_.state_dict[name] is tensor for name, tensor in weights.items()]

    assert copied() == [False, False]
    with xnnpack_patches.patched():
        assert copied() == [True, True]
    assert copied() == [False, False]
