"""Core ML: Apple's backend (CPU, GPU, Neural Engine). Lowers on any OS; the .pte runs only on Apple OSes
(macOS 15+ / iOS 18+, because the K/V caches become Core ML state)."""
import gc
import importlib.metadata
import platform
import sys
import types
from contextlib import contextmanager

import numpy as np

from models.errors import UserFacingError
from quant.schemes import SCHEMES
from recipes.lowering.lower import share_preprocess_weights, swap_attribute
from recipes.registry import Backend, recipe

COMPUTE_UNITS = {"all": "ALL", "cpu_and_ne": "CPU_AND_NE", "cpu_and_gpu": "CPU_AND_GPU", "cpu_only": "CPU_ONLY"}


def coreml_partitioners(precision: str, methods_share_weights: bool = False):
    """methods_share_weights: a program of several methods (a static recipe's prefill and decode) becomes one
    Core ML multifunction model per partition, whose functions share their weights (ExecuTorch's POSITIONAL
    strategy: the methods' partitions pair up by position), instead of one model per method; the caches are
    then inputs, not Core ML state."""
    def partitioners(options: dict) -> list:
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
        from executorch.backends.apple.coreml.compiler.coreml_preprocess import MULTIMETHOD_WEIGHT_SHARING_STRATEGY
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        units = options.get("compute_units", "all")
        if units not in COMPUTE_UNITS:
            raise UserFacingError(f"unknown Core ML compute units {units!r}; choose one of: {', '.join(COMPUTE_UNITS)}.")
        specs = CoreMLBackend.generate_compile_specs(
            compute_unit=getattr(ct.ComputeUnit, COMPUTE_UNITS[units]),
            # iOS 18 / macOS 15 is the first target with model state, which the K/V caches need.
            minimum_deployment_target=ct.target.iOS18,
            compute_precision={"fp16": ct.precision.FLOAT16, "fp32": ct.precision.FLOAT32}[precision],
            # An .mlpackage inside the .pte; a compiled .mlmodelc needs Apple's compiler (macOS only).
            model_type=CoreMLBackend.MODEL_TYPE.MODEL,
        )
        if methods_share_weights:
            specs.append(CoreMLBackend.generate_multimethod_weight_sharing_strategy_compile_spec(
                MULTIMETHOD_WEIGHT_SHARING_STRATEGY.POSITIONAL))
        return [CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=not methods_share_weights)]

    return partitioners


# The coremltools release whose fp16 overflow check and constant comparison are replaced by the chunked ones below
# (fp16_overflow, allclose_by_chunks); on another they are left.
CHUNKED_CHECKS_FOR = "9.0"
CHECK_CHUNK_ELEMENTS = 1 << 20


def overflows_fp16(value) -> bool:
    """coremltools' FP16ComputePrecision.fp16_overflow test of one constant: some finite-looking value
    (|v| < 1e38) beyond fp16's ±65504. The same test a chunk at a time: coremltools' own makes the absolute
    values, a mask and np.where's int64 indices of the whole constant, about 30 bytes per element, which for a
    vocabulary-sized embedding is more than the rest of the conversion holds."""
    flat = np.asarray(value).reshape(-1)
    for start in range(0, flat.size, CHECK_CHUNK_ELEMENTS):
        magnitude = np.abs(flat[start:start + CHECK_CHUNK_ELEMENTS])
        if np.any((magnitude > 65504) & (magnitude < 1e38)):
            return True
    return False


def fp16_overflow(op) -> bool:
    for inputs in op.inputs.values():
        for var in inputs if isinstance(inputs, (list, tuple)) else [inputs]:
            if var.op is not None and var.op.op_type == "const" and var.is_tensor_or_scalar_of(dtype="fp32"):
                if overflows_fp16(var.op.val.val):
                    return True
    return False


def allclose_by_chunks(a, b, rtol: float = 1e-05, atol: float = 1e-08, equal_nan: bool = False) -> bool:
    """np.allclose of two arrays of one shape, a chunk at a time. numpy's own casts both to float64 and makes
    their difference and a mask of the whole arrays, about 25 bytes per element: joining a static recipe's two
    methods compares every weight of one with its twin in the other, and for a vocabulary-sized embedding that
    is more than the rest of the join holds."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return bool(np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))
    a, b = a.reshape(-1), b.reshape(-1)
    return all(np.allclose(a[start:start + CHECK_CHUNK_ELEMENTS], b[start:start + CHECK_CHUNK_ELEMENTS],
                           rtol=rtol, atol=atol, equal_nan=equal_nan)
               for start in range(0, a.size, CHECK_CHUNK_ELEMENTS))


class _NumpyComparingByChunks(types.ModuleType):
    """numpy as coremltools' constant deduplication sees it: the same module, with allclose_by_chunks."""

    allclose = staticmethod(allclose_by_chunks)

    def __getattr__(self, name):
        return getattr(np, name)


def collecting_garbage_around(join):
    """coremltools' join of a static recipe's methods into one multifunction model (ct.utils.save_multifunction)
    with Python's garbage collector run before and after it. Its MIL programs are reference cycles: the methods'
    converted programs before it, and the two it loads from their packages, would otherwise stay in memory until
    a full collection, which may not come before the .pte is written."""
    def join_collecting(*args, **kwargs):
        gc.collect()
        try:
            return join(*args, **kwargs)
        finally:
            gc.collect()

    return join_collecting


@contextmanager
def lowering_patches():
    """Around a Core ML lowering: ExecuTorch's per-partition copies share the weights, which coremltools reads
    into its MIL program and writes anew (fp16 or compressed), never into the torch tensors (a test checks
    the program's weights are untouched by a lowering); its fp16 overflow check, and the comparison by which
    it finds the weights two methods share, go by chunks; the join of two methods frees coremltools' garbage
    before and after it."""
    import coremltools as ct
    from coremltools.converters.mil.mil.passes.defs.cleanup import const_deduplication
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    restores = [share_preprocess_weights(CoreMLBackend),
                swap_attribute(ct.utils, "save_multifunction", collecting_garbage_around(ct.utils.save_multifunction))]
    if importlib.metadata.version("coremltools") == CHUNKED_CHECKS_FOR:
        restores.append(swap_attribute(FP16ComputePrecision, "fp16_overflow", staticmethod(fp16_overflow)))
        restores.append(swap_attribute(sys.modules[const_deduplication.__module__], "np",
                                       _NumpyComparingByChunks("numpy")))
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()


def needs_apple_os() -> str | None:
    if platform.system() == "Darwin":
        return None
    return (
        f"Core ML programs run only on Apple OSes (macOS 15+ / iOS 18+); this is {platform.system()}, so the "
        "generation shown is the same quantized module run eagerly in PyTorch."
    )


NEURAL_ENGINE_NOTE = (
    "CPU_AND_NE lets Core ML place ops on the Neural Engine, falling back to the CPU; which ops run where is Core "
    "ML's decision on the device (Xcode's performance report or MLComputePlan show it), so it cannot be verified off "
    "Apple hardware. The program is shaped for it: fixed shapes, fp16, int4 with one scale per output channel or "
    "4-bit LUTs per group of output channels, linears of at most 1024 outputs, no state between calls")


def describe_options(options: dict) -> dict:
    if options.get("compute_units") == "cpu_and_ne":
        return {"neural_engine": NEURAL_ENGINE_NOTE}
    return {}


BACKEND = Backend(
    name="coreml",
    title="Core ML",
    delegate_id="CoreMLBackend",
    runs_on="Apple OSes only: it needs macOS (15+) or iOS (18+), where Core ML exists",
    partitioners=coreml_partitioners("fp16"),
    # fp16 on Core ML is a compute precision of the fp32 scheme (recipe coreml-fp16), not a cast.
    # fp16 and c4w modules for the static Neural Engine recipes only: a dynamic program's caches are Core ML
    # state, which coremltools reads back as fp32, so there fp16 is a compute precision of the fp32 scheme.
    schemes=("fp32", "int4-weight", "int8-weight", "fp16", "c4w", "p4w"),
    refused={
        "8da4w": "Core ML has no dynamic activation quantization; use int4-weight",
    },
    cannot_run_here=needs_apple_os,
    packages=("coremltools",),
    lowering_context=lowering_patches,
    describe_options=describe_options,
    # coremltools' index_put takes one position only and its gather no bool tensor: the cache is written as
    # one slice and the causal mask built by comparison; the attention is written out, its query heads grouped
    # per kv head, since Core ML computes a fused SDPA wrong on iOS 26.
    attention="grouped-slice",
    # coremltools' MIL program, its fp16 copy of the weights and the .mlpackage, over the converter's own
    # state; writing the .pte copies the .mlpackage's weight files into the program's pieces. Fitted to the
    # zoo's export-only coreml-int4 peaks, 135M to 1.7B, with the chunked overflow check and the weights
    # released before serializing.
    lowering_memory_base_bytes=0.95e9,
    lowering_memory_per_weight=(1.5, 0.75),
    serialize_memory_ratio=4.35,
    # A static recipe's second method: coremltools converts the methods one after the other, then loads both back
    # to join them into one multifunction model whose functions share the weights. Fitted to export-only
    # coreml-ane-c4w on the built-in model and at Llama-3.2-1B's shape (bench/static_methods.py in docs/design.md),
    # with the join's chunked comparison and collections (lowering_patches).
    lowering_memory_per_method=1.5,
)


def _pte_bytes(quantization: str, precision: str) -> tuple[float, float]:
    """fp16 compute stores every float weight (an fp32 module's, the int4 scheme's embedding) in fp16."""
    stored = SCHEMES[quantization].pte_bytes
    return tuple(min(b, 2.0) for b in stored) if precision == "fp16" else stored


# A float module's weights go through coremltools as they are, so its lowering adds less per byte of the
# .pte than a quantized one's, whose weights coremltools unpacks before compressing them again (measured
# at Llama-3.2-1B's shape: coreml-fp16 export-only).
FLOAT_LOWERING_MEMORY_RATIO = 0.96

# The static form the Neural Engine compiles: a prefill chunk of fixed length, and linears of at most 1024 outputs
# (the widths its compiler tiles best; ExecuTorch's static Llama export splits to the same).
ANE_OPTIONS = {"compute_units": "cpu_and_ne", "prefill_chunk": 32, "max_linear_outputs": 1024}

# The dynamic recipes' module stays fp32: Core ML's compute precision casts weights and ops to fp16 itself.
RECIPES = (
    recipe(BACKEND, "fp32", "Core ML, fp16 compute (default)", name="coreml-fp16", options={"compute_units": "all"},
           pte_bytes=_pte_bytes("fp32", "fp16"), lowering_memory_ratio=FLOAT_LOWERING_MEMORY_RATIO),
    recipe(BACKEND, "fp32", "Core ML, fp32 compute", options={"compute_units": "all"},
           partitioners=coreml_partitioners("fp32"), lowering_memory_ratio=FLOAT_LOWERING_MEMORY_RATIO),
    recipe(BACKEND, "int8-weight", "Core ML, int8 per-channel weights, fp16 compute", name="coreml-int8",
           options={"compute_units": "all"}, pte_bytes=_pte_bytes("int8-weight", "fp16")),
    recipe(BACKEND, "int4-weight", "Core ML, int4 weights (group 32), fp16 compute", name="coreml-int4",
           options={"compute_units": "all", "group_size": 32}, pte_bytes=_pte_bytes("int4-weight", "fp16")),
    *(recipe(BACKEND, scheme, f"Core ML for the Neural Engine: {what}; static shapes, prefill and decode methods "
                              "sharing weights, run by run_static.py", name=f"coreml-ane-{scheme}",
             options=dict(ANE_OPTIONS), partitioners=coreml_partitioners("fp16", methods_share_weights=True),
             module_overrides={"fuse_qkv": False}, static_io=True, pte_bytes=_pte_bytes(scheme, "fp16"),
             lowering_memory_ratio=FLOAT_LOWERING_MEMORY_RATIO if scheme == "fp16" else None)
      for scheme, what in (("c4w", "int4 weights per output channel, 8-bit embeddings, fp16"),
                           ("p4w", "4-bit palettized weights, a k-means LUT per output channel (iOS 18's "
                                   "constexpr_lut_to_dense: the Neural Engine decompresses LUTs just in time as it "
                                   "reads the weights, so it runs at full speed on 4-bit codes, the recipe nearest "
                                   "fp32 at about c4w's bytes; c4w's int4 grid is uniform), 8-bit embeddings, fp16"),
                           ("fp16", "fp16"))),
)
