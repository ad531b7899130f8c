"""PT2E quantization: a backend's quantizer annotates the exported graph, torchao's prepare_pt2e inserts
observers, the calibration prompts run through it, convert_pt2e folds the observers into
quantize/dequantize pairs, and the result is exported again. That ExportedProgram is lowered; the
converted module, which takes any number of tokens, is what the eager simulation and fidelity run.

The quantizer comes from the backend that lowers the program (it knows its hardware's encodings); the
flow here is the same for every quantizer."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from models import torch_export

ANNOTATION = "quantization_annotation"  # the node.meta key PT2E quantizers annotate


def is_output_layer(node: torch.fx.Node) -> bool:
    weight = node.args[1] if len(node.args) > 1 else None
    return isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and str(weight.target) == "lm_head.weight"


def share_kv_cache_encoding(gm: torch.fx.GraphModule) -> None:
    """One encoding per KV cache, for the cache read, the keep-mask product and the updated cache.

    The cache update is `cache * keep + onehot.T @ new` (models/llama.py, sdpa-onehot), then copied back
    into the buffer. A moving-average activation observer is started by the first calibration call, which
    reads an empty cache: the read and the product got a range near zero, so every one-token call clamped
    the keys already cached. Sharing one min/max observer across the three makes the buffer hold exactly
    what the next call reads back. A custom annotation: run after the quantizer's own."""
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.copy_.default:
            continue
        buffer, updated = node.args
        if not (buffer.op == "get_attr" and str(buffer.target).endswith("_cache")):
            continue
        reads = [u for u in buffer.users if u is not node and ANNOTATION in u.meta
                 and buffer in u.meta[ANNOTATION].input_qspec_map]
        if len(reads) != 1 or ANNOTATION not in updated.meta:
            raise RuntimeError(f"unexpected KV cache update form around {buffer.target}: reads {reads}")
        read = reads[0]
        spec = read.meta[ANNOTATION].input_qspec_map[buffer]
        observer = MinMaxObserver.with_args(dtype=spec.dtype, quant_min=spec.quant_min, quant_max=spec.quant_max,
                                            qscheme=spec.qscheme)
        read.meta[ANNOTATION].input_qspec_map[buffer] = dataclasses.replace(spec, observer_or_fake_quant_ctr=observer)
        # The read edge comes first in the graph, so the later tensors share its observer (PT2E cannot
        # share with an observer it has not created yet).
        read.meta[ANNOTATION].output_qspec = SharedQuantizationSpec((buffer, read))
        updated.meta[ANNOTATION].output_qspec = SharedQuantizationSpec((buffer, read))


def _forget_cached_modules() -> None:
    """prepare_pt2e and convert_pt2e look up each module's device through functions under an unbounded
    functools.cache keyed by the module: every module quantized stayed referenced there, float weights and
    all, for the rest of the process. The devices are found again when needed."""
    import torch.ao.quantization.fx.utils as torch_fx_utils
    import torchao.utils

    torchao.utils._assert_and_get_unique_device.cache_clear()
    torch_fx_utils.assert_and_get_unique_device.cache_clear()


def drop_unused_state(gm: torch.fx.GraphModule) -> None:
    """Deletes the parameters and buffers no node of the graph reads.

    convert_pt2e folds each weight's quantize op into an integer constant and then deletes the float weights
    it no longer reads, but only those at the module's top level: a nested one (`model.layers.0.mlp...`)
    stays, so every float weight lived on beside its integer copy, in the converted module and in the program
    exported from it, through lowering."""
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    owned = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    for name in {name for name, _ in owned if name not in read}:
        owner, _, attribute = name.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, attribute)


def quantize_pt2e(program: torch.export.ExportedProgram, calibration, quantizer_for: Callable,
                  static_tokens: int | None, max_seq_len: int):
    """(quantized ExportedProgram to lower, converted module that simulates it).

    quantizer_for(module) -> the quantizer that annotates `module` (per-node settings need its graph).
    static_tokens: export the converted program for that many tokens per call (a backend that compiles
    static shapes only), else with the token dimension dynamic as before."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    module = program.module()
    try:
        prepared = prepare_pt2e(module, quantizer_for(module))
        with torch.no_grad():
            for tokens, input_pos in calibration:
                prepared(tokens, input_pos)
        converted = convert_pt2e(prepared)
    finally:
        _forget_cached_modules()
    del module, prepared
    drop_unused_state(converted)
    for name, buffer in converted.named_buffers():
        if name.endswith("_cache"):
            buffer.zero_()  # calibration filled the KV caches; the program starts from empty ones
    tokens = static_tokens or 2
    example = (torch.zeros((1, tokens), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
    dynamic = None if static_tokens else ({1: torch.export.Dim("seq_len", min=1, max=max_seq_len)}, None)
    quantized = torch_export.export(converted, example, dynamic_shapes=dynamic, strict=True)
    # The simulation runs `converted`, which takes any number of tokens: the same quantization, without
    # feeding a prefill or the fidelity text through a static program token by token.
    return quantized, converted
