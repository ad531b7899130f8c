"""XNNPACK: ExecuTorch's CPU backend. The .pte runs here, on the ExecuTorch runtime."""
from recipes.registry import Recipe, register


def xnnpack_partitioners(options: dict) -> list:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


_RUNTIME_IMPORTS = (
    "executorch.extension.llm.custom_ops.custom_ops",  # llama::custom_sdpa, llama::update_cache
    "executorch.kernels.quantized",  # quantized_decomposed::embedding_byte / embedding_4bit
)

register(
    Recipe(
        name="xnnpack-fp32",
        backend="xnnpack",
        quantization="fp32",
        description="XNNPACK, fp32 weights",
        partitioners=xnnpack_partitioners,
        runtime_imports=_RUNTIME_IMPORTS,
    )
)
register(
    Recipe(
        name="xnnpack-8da4w",
        backend="xnnpack",
        quantization="8da4w",
        description="XNNPACK, int8 dynamic activations + int4 weights (group 32), 8-bit embeddings",
        partitioners=xnnpack_partitioners,
        runtime_imports=_RUNTIME_IMPORTS,
        options={"group_size": 32},
    )
)
register(
    Recipe(
        name="xnnpack-8da4w-emb4",
        backend="xnnpack",
        quantization="8da4w-emb4",
        description="XNNPACK, int8 dynamic activations + int4 weights (group 32), 4-bit embeddings",
        partitioners=xnnpack_partitioners,
        runtime_imports=_RUNTIME_IMPORTS,
        options={"group_size": 32},
    )
)
register(
    Recipe(
        name="xnnpack-8da8w",
        backend="xnnpack",
        quantization="8da8w",
        description="XNNPACK, int8 dynamic activations + int8 per-channel weights, 8-bit embeddings",
        partitioners=xnnpack_partitioners,
        runtime_imports=_RUNTIME_IMPORTS,
    )
)
register(
    Recipe(
        name="xnnpack-fp16",
        backend="xnnpack",
        quantization="fp16",
        description="XNNPACK, fp16 weights and activations",
        partitioners=xnnpack_partitioners,
        # llama::custom_sdpa has no fp16 kernel; aten SDPA outside the delegate runs fp16 on the portable ops.
        attention="sdpa",
        runtime_imports=_RUNTIME_IMPORTS,
    )
)
