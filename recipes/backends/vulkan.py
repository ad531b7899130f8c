"""Vulkan: ExecuTorch's GPU backend (Android first; any Vulkan 1.1 GPU). Lowers on any OS; the .pte needs an
ExecuTorch runtime built with the Vulkan backend, which the executorch wheel does not have, so the column
shows the same module run eagerly in PyTorch, labelled, with the reason.

Module form: ExecuTorch's llama::update_cache + llama::custom_sdpa, which Vulkan implements for dynamic
shapes, so the whole decoder stack (cache writes and attention included) is one delegate; in the aten SDPA
forms the cache writes (index_put, slice_scatter) and mask ops are not delegable with dynamic shapes. Norms in Hugging Face's form, which
Vulkan's preprocessing fuses into one et_vk.rms_norm each. q/k/v fused: the same delegation with fewer
nodes. The token dimension stays dynamic (require_dynamic_shapes), as ExecuTorch's own Llama export
does: only the rope-table lookup (index_select) and the position arange run outside."""
from __future__ import annotations

import torch

from recipes.registry import Backend, recipe

DELEGATE_ID = "VulkanBackend"


def without_symbol_only_partitions(partitioner):
    """Untags partitions that compute no tensor: with dynamic shapes the partitioner proposes one holding
    just the sym_size the unsupported prologue reads, and Vulkan's preprocessing cannot plan a graph that
    outputs no tensor ("graph_output_allocated not set"). Its nodes run outside, as they would anyway."""
    original = partitioner.partition

    def partition(program):
        result = original(program)
        groups: dict[str, list] = {}
        for node in program.graph_module.graph.nodes:
            tag = node.meta.get("delegation_tag")
            if tag is not None and node.op == "call_function":
                groups.setdefault(tag, []).append(node)
        for tag, nodes in groups.items():
            if not any(isinstance(n.meta.get("val"), torch.Tensor) for n in nodes):
                for node in nodes:
                    del node.meta["delegation_tag"]
                result.partition_tags.pop(tag, None)
        return result

    partitioner.partition = partition
    return partitioner


def vulkan_partitioners(force_fp16: bool):
    def partitioners(options: dict) -> list:
        from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

        compile_options = {"require_dynamic_shapes": True, "force_fp16": force_fp16}
        return [without_symbol_only_partitions(VulkanPartitioner(compile_options))]

    return partitioners


def no_vulkan_runtime() -> str | None:
    from executorch.runtime import Runtime

    if Runtime.get().backend_registry.is_available(DELEGATE_ID):
        return None
    return ("this ExecuTorch runtime has no Vulkan backend (the executorch wheel ships none), so the generation "
            "shown is the same module run eagerly in PyTorch")


BACKEND = Backend(
    name="vulkan",
    title="Vulkan",
    delegate_id=DELEGATE_ID,
    runs_on="devices with a Vulkan 1.1 GPU (Android first) on an ExecuTorch runtime built with its Vulkan backend",
    partitioners=vulkan_partitioners(force_fp16=False),
    schemes=("fp32",),
    refused={
        "fp16": "use the vulkan-fp16 recipe: the Vulkan delegate computes in fp16 itself (force_fp16)",
        "int4-weight": "not offered: Vulkan's int4 linear (et_vk.linear_q4gsw) fails to pack an output layer of 18 "
                       "rows (it pads them to 20), and its numerics cannot be checked without a Vulkan runtime",
    },
    cannot_run_here=no_vulkan_runtime,
    attention="custom",
    fuse_qkv=True,
    # The custom-ops form exports to the same program non-strict, in a third of the time.
    strict_export=False,
    runtime_imports=("executorch.extension.llm.custom_ops.custom_ops",),
)

RECIPES = (
    recipe(BACKEND, "fp32", "Vulkan GPU, fp32"),
    # The module stays fp32: the delegate stores weights and computes in fp16 (ExecuTorch's force_fp16).
    recipe(BACKEND, "fp32", "Vulkan GPU, fp16 compute", name="vulkan-fp16",
           partitioners=vulkan_partitioners(force_fp16=True)),
)
