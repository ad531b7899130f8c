"""XNNPACK: ExecuTorch's CPU backend. The .pte runs here, on the ExecuTorch runtime."""
from recipes.registry import Recipe, register


def xnnpack_partitioners(options: dict) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


_RUNTIME_IMPORTS = (
    "executorch.extension.llm.custom_ops.custom_ops",  # llama::custom_sdpa, llama::update_cache
    "executorch.kernels.quantized",  # quantized_decomposed::embedding_byte / embedding_4bit
)


def _xnnpack(name: str, quantization: str, description: str, attention: str = "custom", **options) -> Recipe:
    return register(
        Recipe(
            name=name,
            backend="xnnpack",
            quantization=quantization,
            description=description,
            partitioners=xnnpack_partitioners,
            attention=attention,
            runtime_imports=_RUNTIME_IMPORTS,
            options=options,
            # the edge program's constants and the packed delegate blobs, beside the quantized module
            lowering_memory_ratio=2.8,
        )
    )


_xnnpack("xnnpack-fp32", "fp32", "XNNPACK, fp32 weights")
_xnnpack("xnnpack-8da4w", "8da4w",
         "XNNPACK, int8 dynamic activations + int4 weights (group 32), 8-bit embeddings", group_size=32)
_xnnpack("xnnpack-8da4w-emb4", "8da4w-emb4",
         "XNNPACK, int8 dynamic activations + int4 weights (group 32), 4-bit embeddings", group_size=32)
_xnnpack("xnnpack-8da8w", "8da8w", "XNNPACK, int8 dynamic activations + int8 per-channel weights, 8-bit embeddings")
# llama::custom_sdpa has no fp16 kernel; aten SDPA outside the delegate runs fp16 on the portable ops.
_xnnpack("xnnpack-fp16", "fp16", "XNNPACK, fp16 weights and activations", attention="sdpa")
