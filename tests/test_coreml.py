"""Core ML recipes: lowering on Linux through the one lowering call site, the delegation report with
preserved ops and partitioner reasons, and the clear "needs macOS" message from the runtime."""
import platform
from collections import Counter

import pytest
import torch

from models.errors import UserFacingError

IO_GLUE = {"getitem"}  # unpacking the delegate's outputs; what may stay outside a full delegation
# MIL ops that would be a fused attention or a copy of the kv heads for the query heads
FUSED_OR_COPIED_ATTENTION = {"scaled_dot_product_attention", "tile", "repeat", "repeat_interleave"}


def mil_ops(pte: bytes, folder) -> dict[str, Counter]:
    """{Core ML function: how many of each MIL op} of every Core ML model inside a .pte: the .mlpackage ExecuTorch
    stores per delegate, read back as coremltools wrote it (a multifunction model has a function per method)."""
    import coremltools as ct
    from executorch.examples.apple.coreml.scripts.extract_coreml_models import extract_coreml_models

    functions = {}
    for extracted in extract_coreml_models(pte, folder):
        for package in sorted(extracted.rglob("*.mlpackage")):
            spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
            for name, function in spec.mlProgram.functions.items():
                blocks = function.block_specializations.values()
                functions[name] = sum((Counter(op.type for op in block.operations) for block in blocks),
                                      functions.get(name, Counter()))
    return functions


def assert_attention_written_out(functions: dict[str, Counter], layers: int) -> None:
    """Each layer attends by two matmuls and a softmax, with no fused SDPA and no tile or repeat of kv heads."""
    assert functions
    for name, ops in functions.items():
        assert not FUSED_OR_COPIED_ATTENTION & set(ops), (name, ops)
        assert (ops["matmul"], ops["softmax"]) == (2 * layers, layers), (name, ops)


class WithAcosh(torch.nn.Module):
    """The tiny Llama followed by acosh, an op the Core ML partitioner refuses (coremltools lacks it)."""

    def __init__(self, llama):
        super().__init__()
        self.llama = llama

    def forward(self, tokens, input_pos):
        return torch.acosh(self.llama(tokens, input_pos).abs() + 1.0)

    def reset_cache(self):
        self.llama.reset_cache()


@pytest.fixture(scope="module")
def tiny_coreml_int8_with_acosh(tiny_checkpoint):
    from models.llama import build_exportable
    from quant.schemes import apply_scheme
    from recipes.lowering.llm_metadata import llm_metadata
    from recipes.lowering.lower import Lowering, export_program, lower_for_backend
    from recipes.registry import get_recipe

    recipe = get_recipe("coreml-int8")
    options = recipe.export_options(64)
    module = WithAcosh(build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, options))
    apply_scheme(module, recipe.quantization)
    program = export_program(module, options.max_seq_len, strict=recipe.backend.strict_export)
    metadata = llm_metadata(program, options.max_seq_len, tiny_checkpoint.config, tiny_checkpoint.tokenizer, [2])
    return lower_for_backend(program, recipe, recipe.options, Lowering(constant_methods=metadata))


def test_coreml_recipes_registered_and_say_where_they_run():
    from recipes.registry import get_recipe

    for name in ("coreml-fp16", "coreml-fp32", "coreml-int8", "coreml-int4"):
        recipe = get_recipe(name)
        assert recipe.backend.name == "coreml" and recipe.export_options(64).attention == "grouped-slice"
        if platform.system() != "Darwin":
            assert "Apple" in recipe.backend.cannot_run_here()
    with pytest.raises(UserFacingError, match="compute units"):
        get_recipe("coreml-fp16").make_partitioners({"compute_units": "gpu_only"})


def test_sdpa_slice_and_grouped_slice_modules_match_sdpa(tiny_checkpoint):
    """Core ML's forms: the sliced cache write, and the attention written out with grouped query heads."""
    from models.llama import ExportOptions, build_exportable

    tokens = torch.tensor([[1, 4, 6, 8, 3]])
    outs = []
    for attention in ("sdpa", "sdpa-slice", "grouped-slice"):
        module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, attention=attention))
        with torch.no_grad():
            outs.append(torch.cat([module(tokens[:, :3], torch.tensor([0])), module(tokens[:, 3:4], torch.tensor([3])),
                                   module(tokens[:, 4:5], torch.tensor([4]))], dim=1))
    assert all((outs[0] - out).abs().max().item() < 1e-5 for out in outs[1:])


def test_unsupported_op_stays_outside_with_its_reason(tiny_coreml_int8_with_acosh):
    table = tiny_coreml_int8_with_acosh.delegation
    ops = {o.op: o for o in table.ops}
    acosh = ops["aten_acosh_default"]
    assert acosh.non_delegated == 1 and acosh.delegated == 0
    reasons = [r["reason"] for r in acosh.why_not_delegated]
    assert any("not supported by CoreML" in r for r in reasons), reasons
    assert all(r["source"].startswith("executorch.backends.apple.coreml") for r in acosh.why_not_delegated)
    assert (ops["aten_linear_default"].delegated, ops["aten_linear_default"].non_delegated) == (15, 0)
    assert ops["torchao_dequantize_affine_default"].non_delegated == 0
    assert "aten_scaled_dot_product_attention_default" not in ops
    assert (ops["aten_matmul_default"].delegated, ops["aten_softmax_int"].delegated) == (4, 2)
    assert table.edge_nodes_before_partitioning == tiny_coreml_int8_with_acosh.edge_nodes_before_partitioning
    assert ops["aten_linear_default"].before_partitioning == 15


def test_dynamic_coreml_program_attends_without_fused_sdpa_or_copied_kv_heads(tiny_coreml_int8_with_acosh,
                                                                             tiny_checkpoint, tmp_path):
    """The MIL program coremltools built: each layer's attention is written out over grouped query heads."""
    functions = mil_ops(tiny_coreml_int8_with_acosh.pte, tmp_path)
    assert list(functions) == ["main"]
    assert_attention_written_out(functions, tiny_checkpoint.config.num_hidden_layers)
    assert functions["main"]["write_state"] == 2 * tiny_checkpoint.config.num_hidden_layers


def test_coreml_pte_lists_the_llm_runners_metadata_methods(tiny_coreml_int8_with_acosh):
    """What ExecuTorch's iOS runner reads at load; the program API lists them without running the delegate."""
    from executorch.runtime import Runtime

    from tests.test_deploy import METADATA_METHODS

    methods = set(Runtime.get().load_program(tiny_coreml_int8_with_acosh.pte).method_names)
    assert methods == METADATA_METHODS | {"forward"}


@pytest.mark.skipif(platform.system() == "Darwin", reason="the Core ML runtime exists on macOS")
def test_runtime_load_says_needs_macos(tiny_coreml_int8_with_acosh, tmp_path):
    from recipes.running.generate import delegate_backends, load_runtime_method

    pte = tmp_path / "model.pte"
    pte.write_bytes(tiny_coreml_int8_with_acosh.pte)
    assert delegate_backends(pte) == ["CoreMLBackend"]
    with pytest.raises(UserFacingError, match="needs macOS") as err:
        load_runtime_method(pte)
    assert "CoreMLBackend" in str(err.value)


def test_tiny_llama_lowers_to_coreml_int4_with_every_linear_and_attention_inside(tiny_llama_dir, tmp_path):
    """coreml-int4 through run(): every linear (7 per layer and the output layer), its dequantize and the
    attention go into the Core ML program; off Apple OSes the column is the eager module, said so."""
    import json

    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    name = "coreml-int4"
    summary = run(RunRequest(recipes=[name], out_dir=tmp_path, model=str(tiny_llama_dir), max_seq_len=32,
                             max_new_tokens=3, prompt="what is the capital ?"))
    report = summary.recipes[0]
    assert report.errors == []
    # the default algorithm: AWQ's scales, searched as the module was built
    assert report.quantization.algorithm == "awq" and report.quantization.calibration.tokens > 0
    assert (tmp_path / "model.pte").stat().st_size == report.pte.bytes
    delegation = report.delegation
    ops = {o.op: o for o in delegation.ops}
    assert ops["aten_linear_default"].delegated == layers * 7 + 1 and ops["aten_linear_default"].non_delegated == 0
    assert ops["aten_matmul_default"].delegated == 2 * layers and ops["aten_softmax_int"].delegated == layers
    assert "aten_scaled_dot_product_attention_default" not in ops
    assert {o.op for o in delegation.ops if o.non_delegated} <= IO_GLUE
    assert delegation.non_delegated_nodes <= 2
    assert delegation.edge_nodes_before_partitioning == delegation.delegated_nodes
    assert ops["torchao_dequantize_affine_default"].delegated == layers * 7 + 1
    engines = [g.engine for g in report.generations]
    if platform.system() != "Darwin":
        assert engines == ["eager-fp32", "eager-quantized"] and "Apple" in report.runtime_note
        assert report.profile is None and "Apple" in report.profile_note

def test_preprocessing_shares_the_weights_and_leaves_them_as_they_were(tiny_checkpoint):
    """ExecuTorch copies each partition's program before Core ML preprocesses it; Core ML's copy shares the
    weights, which is only right while coremltools never writes into them: after a real int8 lowering every
    weight of the program still holds its values."""
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    from models.llama import build_exportable
    from quant.schemes import apply_scheme
    from recipes.lowering.lower import export_program, lower_for_backend
    from recipes.registry import get_recipe

    recipe = get_recipe("coreml-int8")
    options = recipe.export_options(32)
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, options)
    apply_scheme(module, recipe.quantization)
    program = export_program(module, options.max_seq_len, strict=recipe.backend.strict_export)
    def plain(tensor):  # a torchao weight's inner tensors (int values, scales), or the tensor itself
        if type(tensor) is torch.Tensor or isinstance(tensor, torch.nn.Parameter) and type(tensor.data) is torch.Tensor:
            return [tensor]
        return [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]

    tensors = [inner for t in {**program.state_dict, **program.constants}.values() if isinstance(t, torch.Tensor)
               for inner in plain(t)]
    values = [t.clone() for t in tensors]
    assert len(tensors) > len(program.state_dict)  # the int8 linears' values and scales are among them

    with recipe.backend.lowering_context():
        copy_ = CoreMLBackend.copy_exported_program_for_preprocess(program, [])
        assert copy_.graph_module is not program.graph_module
        assert all(copy_.state_dict[name] is t for name, t in program.state_dict.items())
    outside = CoreMLBackend.copy_exported_program_for_preprocess(program, [])
    assert not any(outside.state_dict[name] is t for name, t in program.state_dict.items())

    lowered = lower_for_backend(program, recipe, recipe.options)
    assert lowered.delegation.delegated_subgraphs == 1
    assert all(torch.equal(tensor, value) for tensor, value in zip(tensors, values))


def test_the_chunked_fp16_overflow_check_answers_as_coremltools_own_and_is_undone_after_lowering():
    """Core ML's lowering swaps coremltools' fp16 overflow check, whose temporaries outgrow a vocabulary-sized
    embedding, for one by chunks: the same answer on every kind of constant, and coremltools' own after."""
    import numpy as np
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    from recipes.backends.coreml import CHECK_CHUNK_ELEMENTS, lowering_patches, overflows_fp16

    own = FP16ComputePrecision.fp16_overflow
    big = np.zeros(3 * CHECK_CHUNK_ELEMENTS + 5, dtype=np.float32)
    cases = {"small": np.float32([[1.0, -2.0], [65504, -65504]]), "overflow": np.float32([[1.0, 70000.0]]),
             "infinities only": np.float32([-np.inf, 1e39, 3.0]), "nan": np.float32([np.nan, 1.0]),
             "scalar": np.float32(-1e5), "last chunk": np.concatenate([big, np.float32([-66000.0])]), "zeros": big}
    for name, value in cases.items():
        expected = bool(np.max(np.abs(np.expand_dims(value, 0))[np.where(np.abs(np.expand_dims(value, 0)) < 1e38)],
                               initial=0.0) > 65504)
        assert overflows_fp16(value) == expected, name
    assert overflows_fp16(cases["overflow"]) and overflows_fp16(cases["last chunk"])
    with lowering_patches():
        assert FP16ComputePrecision.fp16_overflow is not own
    assert FP16ComputePrecision.fp16_overflow is own


def test_joining_two_methods_compares_their_weights_by_chunks_with_numpys_answers():
    """The comparison by which coremltools finds the weights a static recipe's two methods share goes by chunks
    inside a Core ML lowering: numpy's answer on every kind of pair, and numpy's own function after."""
    import sys

    import numpy as np
    from coremltools.converters.mil.mil.passes.defs.cleanup import const_deduplication

    from recipes.backends.coreml import CHECK_CHUNK_ELEMENTS, allclose_by_chunks, lowering_patches

    module = sys.modules[const_deduplication.__module__]
    weights = np.random.default_rng(0).integers(-8, 8, 2 * CHECK_CHUNK_ELEMENTS + 7, dtype=np.int8)
    last_differs = weights.copy()
    last_differs[-1] = 7 if weights[-1] != 7 else 6
    halves = np.float16(np.linspace(-3, 3, 4 * CHECK_CHUNK_ELEMENTS // 3))
    cases = [(weights, weights.copy(), 1e-12), (weights, last_differs, 1e-12), (halves, halves + np.float16(6e-8), 6e-8),
             (halves, halves * np.float16(1.01), 6e-8), (np.float32([np.nan, 1]), np.float32([np.nan, 1]), 1e-12),
             (weights.reshape(-1, 1)[:10], weights[:10].reshape(2, 5).reshape(-1, 1), 1e-12)]
    for a, b, atol in cases:
        assert allclose_by_chunks(a, b, rtol=0.0, atol=atol) == np.allclose(a, b, rtol=0.0, atol=atol)
    assert allclose_by_chunks(weights, weights.copy(), rtol=0.0, atol=1e-12)
    assert not allclose_by_chunks(weights, last_differs, rtol=0.0, atol=1e-12)
    with lowering_patches():
        assert module.np.allclose is allclose_by_chunks and module.np.prod is np.prod
    assert module.np is np


def test_joining_two_methods_frees_garbage_cycles_before_and_after_it_and_is_undone_after_lowering():
    """coremltools' MIL programs are reference cycles: the join of a static recipe's methods runs the collector
    before it (the methods' converted programs) and after it (the two programs it loads)."""
    import gc
    import weakref

    import coremltools as ct

    from recipes.backends.coreml import collecting_garbage_around, lowering_patches

    class Op:
        pass

    def garbage_cycle() -> weakref.ref:
        op, block = Op(), Op()
        op.block, block.op = block, op
        return weakref.ref(op)

    seen = {}

    def join(desc, destination_path):
        seen["earlier garbage gone"] = earlier() is None
        seen["its own"] = garbage_cycle()
        return destination_path

    gc.disable()  # only the join's own collections run
    try:
        earlier = garbage_cycle()
        assert earlier() is not None
        assert collecting_garbage_around(join)("desc", "combined.mlpackage") == "combined.mlpackage"
        assert seen["earlier garbage gone"] and seen["its own"]() is None
    finally:
        gc.enable()
    own = ct.utils.save_multifunction
    with lowering_patches():
        assert ct.utils.save_multifunction is not own
    assert ct.utils.save_multifunction is own


@pytest.fixture(scope="module")
def tiny_ane_p4w(tiny_llama_dir, tmp_path_factory):
    """coreml-ane-p4w on the tiny Llama through run(), export only, prefill chunks of 4."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("ane-p4w")
    summary = run(RunRequest(recipes=["coreml-ane-p4w"], out_dir=out, model=str(tiny_llama_dir), max_seq_len=32,
                             max_new_tokens=4, generate=False, options={"prefill_chunk": 4}))
    return out, summary.recipes[0]


def test_palettized_recipe_lowers_every_linear_to_a_lut_decompression_in_the_mil_program(tiny_ane_p4w, tiny_checkpoint,
                                                                                        tmp_path):
    """Both methods of the Neural Engine program decompress each linear's weights from its LUTs (iOS 18's
    constexpr_lut_to_dense), the 8-bit embedding by its scales, and attend without fused SDPA."""
    out, report = tiny_ane_p4w
    assert not report.errors, report.errors
    layers = tiny_checkpoint.config.num_hidden_layers
    functions = mil_ops((out / "model.pte").read_bytes(), tmp_path)
    assert set(functions) == {"forward", "prefill"}
    for name, ops in functions.items():
        assert ops["constexpr_lut_to_dense"] == 7 * layers + 1, (name, ops)
        assert ops["constexpr_blockwise_shift_scale"] == 1, (name, ops)
    assert_attention_written_out(functions, layers)
    assert report.recipe.options["compute_units"] == "cpu_and_ne"


def test_palettized_module_computes_close_to_fp32_where_a_broken_lut_would_not(tiny_checkpoint):
    """The eager simulation of coreml-ane-p4w (the static module, fp16, every linear from its LUTs) against the fp32
    module on the evaluation text; the same module with each LUT's entries reversed misses the same bound."""
    from models.llama import ExportOptions, build_exportable
    from quant.palettize import PalettizedTensor
    from quant.quantize import cast_quantized
    from quant.schemes import apply_scheme
    from recipes.evaluation import fidelity
    from recipes.lowering.static_program import eager_session, static_form
    from recipes.registry import get_recipe
    from recipes.running.generate import eager_step

    context = 32
    recipe = get_recipe("coreml-ane-p4w")
    checkpoint = tiny_checkpoint
    reference = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa"))
    ids = fidelity.eval_token_ids(checkpoint.tokenizer)[:context]
    expected = fidelity.sequence_logits(eager_step(reference), ids, context)
    module = build_exportable(checkpoint.config, checkpoint.state_dict, recipe.export_options(context))
    apply_scheme(module, recipe.quantization)
    static = static_form(cast_quantized(module, recipe.quantization), {"max_linear_outputs": 32})
    weights = [m.weight for m in static.modules() if isinstance(getattr(m, "weight", None), PalettizedTensor)]
    assert len(weights) > 7 * checkpoint.config.num_hidden_layers

    def relative_error() -> float:
        logits = fidelity.sequence_logits(eager_session(static, 4).step, ids, context).float()
        return ((logits - expected).norm() / (expected - expected.mean(-1, keepdim=True)).norm()).item()

    # the logits' error as a share of their spread: about c4w's per-channel grid's here; reversed LUTs far past it
    assert relative_error() < 0.3
    for weight in weights:
        weight.codebook = weight.codebook.flip(2)
    assert relative_error() > 1.0
