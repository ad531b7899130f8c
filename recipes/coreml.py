"""Core ML: Apple's backend (CPU, GPU, Neural Engine). Lowers on any OS; the .pte runs only on Apple OSes
(macOS 15+ / iOS 18+, because the K/V caches become Core ML state)."""
import platform

from errors import UserFacingError
from recipes.registry import Recipe, register

COMPUTE_UNITS = {"all": "ALL", "cpu_and_ne": "CPU_AND_NE", "cpu_and_gpu": "CPU_AND_GPU", "cpu_only": "CPU_ONLY"}


def coreml_partitioners(precision: str):
    def partitioners(options: dict) -> list:
        import coremltools as ct
        from executorch.backends.apple.coreml.compiler import CoreMLBackend
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
        return [CoreMLPartitioner(compile_specs=specs, take_over_mutable_buffer=True)]

    return partitioners


def needs_apple_os() -> str | None:
    if platform.system() == "Darwin":
        return None
    return (
        f"Core ML programs run only on Apple OSes (macOS 15+ / iOS 18+); this is {platform.system()}, so the "
        "generation shown is the same quantized module run eagerly in PyTorch."
    )


def _pte_bytes(quantization: str, precision: str) -> tuple[float, float]:
    """fp16 compute stores every float weight (an fp32 module's, the int4 scheme's embedding) in fp16."""
    from quant.schemes import SCHEMES

    stored = SCHEMES[quantization].pte_bytes
    return tuple(min(b, 2.0) for b in stored) if precision == "fp16" else stored


def _coreml(name: str, quantization: str, precision: str, description: str, **options) -> Recipe:
    return register(
        Recipe(
            name=name,
            backend="coreml",
            quantization=quantization,
            description=description,
            partitioners=coreml_partitioners(precision),
            attention="sdpa-slice",
            # The module stays fp32: Core ML's compute precision casts weights and ops to fp16 itself.
            cannot_run_here=needs_apple_os,
            options={"compute_units": "all", **options},
            pte_bytes=_pte_bytes(quantization, precision),
            # coremltools' MIL program, its fp16 copy of the weights and the .mlpackage (from a 1B export-only peak)
            lowering_memory_ratio=9.0,
        )
    )


_coreml("coreml-fp16", "fp32", "fp16", "Core ML, fp16 compute (default)")
_coreml("coreml-fp32", "fp32", "fp32", "Core ML, fp32 compute")
_coreml("coreml-int8", "int8-weight", "fp16", "Core ML, int8 per-channel weights, fp16 compute")
_coreml("coreml-int4", "int4-weight", "fp16", "Core ML, int4 weights (group 32), fp16 compute", group_size=32)
