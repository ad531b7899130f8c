"""XNNPACK: ExecuTorch's CPU backend. The .pte runs here, on the ExecuTorch runtime.

Its module form: ExecuTorch's llama::update_cache + llama::custom_sdpa (they attend only to the filled part
of the cache, outside the delegate), q/k/v fused into one linear, and the norms' mean of squares as a linear
(XNNPACK's mean is a global average pooling that takes only 4-D channels-last input, so it would come with
two layout changes per norm and split every layer). Its lowering runs with the speed patches of
recipes/xnnpack_patches.py, which only this backend imports: they target XNNPACK's passes and its lowering
path, and are checked (same bytes or same logits) on it alone."""
from recipes.registry import Backend, recipe
from recipes.xnnpack_patches import patched


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
    runtime_imports=(
        "executorch.extension.llm.custom_ops.custom_ops",  # llama::custom_sdpa, llama::update_cache
        "executorch.kernels.quantized",  # quantized_decomposed::embedding_byte / embedding_4bit
    ),
    lowering_context=patched,
    # The edge program's constants and the packed delegate blobs, beside the quantized module; the copy of each
    # partition made for preprocessing shares the weights (xnnpack_patches.py, patch 5).
    lowering_memory_ratio=1.0,
    lowering_memory_per_layer_bytes=17e6,
    serialize_memory_ratio=1.25,
)

RECIPES = (
    recipe(BACKEND, "fp32", "XNNPACK, fp32 weights"),
    recipe(BACKEND, "8da4w", "XNNPACK, int8 dynamic activations + int4 weights (group 32), 8-bit embeddings",
           options={"group_size": 32}),
    recipe(BACKEND, "8da4w-emb4", "XNNPACK, int8 dynamic activations + int4 weights (group 32), 4-bit embeddings",
           options={"group_size": 32}),
    recipe(BACKEND, "8da8w", "XNNPACK, int8 dynamic activations + int8 per-channel weights, 8-bit embeddings"),
    # llama::custom_sdpa has no fp16 kernel; aten SDPA outside the delegate runs fp16 on the portable ops,
    # with q/k/v as three linears, the form this recipe is checked in.
    recipe(BACKEND, "fp16", "XNNPACK, fp16 weights and activations",
           module_overrides={"attention": "sdpa", "fuse_qkv": False}),
)
