"""PT2E quantization schemes for Qualcomm QNN: QnnQuantizer annotates the exported graph, torchao's
prepare_pt2e inserts observers, the calibration prompts run through it, convert_pt2e folds the
observers into quantize/dequantize pairs, and the result is exported again and given QNN's
export-pipeline passes. That ExportedProgram is lowered; the converted module, which takes any number of
tokens, is what the QNN column's eager-qnn-simulated generation and fidelity run."""
from __future__ import annotations

import dataclasses

import torch

from quant.schemes import SCHEMES, Scheme

# scheme name -> QuantDtype member of executorch.backends.qualcomm.quantizer.quantizer
QNN_QUANT_DTYPES = {"qnn-16a4w": "use_16a4w", "qnn-16a8w": "use_16a8w", "qnn-8a8w": "use_8a8w"}


# 16a4w as ExecuTorch's own Qualcomm LLM recipes make it (examples/qualcomm/oss_scripts/llama/
# static_llm_quant_recipe.py): 4-bit weights in blocks of 32 input channels (QNN's LPBQ block-wise expansion),
# and the output layer in 8-bit. Measured on SmolLM2-135M, first 160 tokens of quant/eval_text.txt,
# perplexity ratio to fp32 in simulation: 4-bit per output channel x4.1; blocks of 32 x1.73; blocks of 32
# with an 8-bit output layer x1.57 (16a8w: x1.08).
QNN_16A4W_BLOCK = 32
BLOCK_QUANTIZED_SCHEMES = ("qnn-16a4w",)


def _is_output_layer(node: torch.fx.Node) -> bool:
    weight = node.args[1] if len(node.args) > 1 else None
    return isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and str(weight.target) == "lm_head.weight"


_ANNOTATION = "quantization_annotation"  # the node.meta key PT2E quantizers annotate


def share_kv_cache_encoding(gm: torch.fx.GraphModule) -> None:
    """One encoding per KV cache, for the cache read, the keep-mask product and the updated cache.

    The cache update is `cache * keep + onehot.T @ new` (models/llama.py, sdpa-onehot), then copied back
    into the buffer. QNN's default activation observer is a moving average started by the first
    calibration call, which reads an empty cache: the read and the product got a range near zero, so every
    one-token call clamped the keys already cached to about +-0.3 (the simulated logits of prefill +
    decode were up to 15 away from a whole-prompt call's). Sharing one min/max observer across the three
    makes the buffer hold exactly what the next call reads back."""
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.copy_.default:
            continue
        buffer, updated = node.args
        if not (buffer.op == "get_attr" and str(buffer.target).endswith("_cache")):
            continue
        reads = [u for u in buffer.users if u is not node and _ANNOTATION in u.meta
                 and buffer in u.meta[_ANNOTATION].input_qspec_map]
        if len(reads) != 1 or _ANNOTATION not in updated.meta:
            raise RuntimeError(f"unexpected KV cache update form around {buffer.target}: reads {reads}")
        read = reads[0]
        spec = read.meta[_ANNOTATION].input_qspec_map[buffer]
        observer = MinMaxObserver.with_args(dtype=spec.dtype, quant_min=spec.quant_min, quant_max=spec.quant_max,
                                            qscheme=spec.qscheme)
        read.meta[_ANNOTATION].input_qspec_map[buffer] = dataclasses.replace(spec, observer_or_fake_quant_ctr=observer)
        # The read edge comes first in the graph, so the later tensors share its observer (PT2E cannot
        # share with an observer it has not created yet).
        read.meta[_ANNOTATION].output_qspec = SharedQuantizationSpec((buffer, read))
        updated.meta[_ANNOTATION].output_qspec = SharedQuantizationSpec((buffer, read))


def qnn_quantizer(scheme: str, options: dict, graph: torch.fx.Graph):
    """graph: the graph the quantizer will annotate (16a4w's block sizes are given per node name)."""
    from recipes.qnn import chipset

    soc, _arch = chipset(options)  # also imports executorch.backends.qualcomm without an SDK download
    from executorch.backends.qualcomm.quantizer.quantizer import ModuleQConfig, QnnQuantizer, QuantDtype

    quantizer = QnnQuantizer(soc_model=soc)
    quantizer.add_custom_quant_annotations((share_kv_cache_encoding,))
    if scheme in BLOCK_QUANTIZED_SCHEMES:
        quantizer.set_default_quant_config(QuantDtype.use_16a4w_block, is_conv_per_channel=True,
                                           is_linear_per_channel=True)
        linears = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.linear.default]
        quantizer.set_block_size_map({n.name: (1, QNN_16A4W_BLOCK) for n in linears if not _is_output_layer(n)})
        quantizer.set_submodule_qconfig_list([
            (_is_output_layer, ModuleQConfig(QuantDtype.use_16a8w, is_linear_per_channel=True)),
        ])
        return quantizer
    # Per-channel weights: per-tensor weights lose too much on a language model.
    quantizer.set_default_quant_config(
        getattr(QuantDtype, QNN_QUANT_DTYPES[scheme]), is_conv_per_channel=True, is_linear_per_channel=True
    )
    return quantizer


def quantize_exported_qnn(scheme: str, program: torch.export.ExportedProgram, calibration, options: dict):
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from recipes.qnn import import_qnn_backend

    import_qnn_backend()
    from executorch.backends.qualcomm._passes.backends.htp.qnn_htp_pass_manager import QnnHtpPassManager

    # prepare_pt2e runs QnnQuantizer.transform_for_annotation (QNN's annotation-pipeline passes) itself.
    module = program.module()
    prepared = prepare_pt2e(module, qnn_quantizer(scheme, options, module.graph))
    with torch.no_grad():
        for tokens, input_pos in calibration:
            prepared(tokens, input_pos)
    converted = convert_pt2e(prepared)
    for name, buffer in converted.named_buffers():
        if name.endswith("_cache"):
            buffer.zero_()  # calibration filled the KV caches; the program starts from empty ones
    # QNN HTP compiles static shapes only: the program is exported again for one token per call
    # (prefill then runs token by token, as ExecuTorch's QNN Llama runner does in its KV mode).
    one_token = (torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
    with torch.no_grad():
        quantized = torch.export.export(converted, one_token, strict=True)
    # The simulation runs `converted`, which takes any number of tokens: the same quantization, without
    # feeding a prefill or the fidelity text through the one-token program token by token.
    # 16a4w: the linears go to QNN as 1x1 conv2d (ExecuTorch's ConvertLinearToConv2d, the form upstream's Qualcomm
    # Llama uses; block sizes become (1, 32, 1, 1), the same numbers). QNN 2.47's HTP graph prepare rejects a
    # block-quantized (LPBQ) FullyConnected with more than 256 output channels ("no properties registered for
    # q::GenPad"); Conv2d takes the same weights. Measured in docs/qnn.md.
    program = QnnHtpPassManager().transform_for_export_pipeline(
        quantized, convert_linear_to_conv2d=scheme in BLOCK_QUANTIZED_SCHEMES
    )
    return program, converted


def _scheme(name: str, description: str) -> Scheme:
    return Scheme(
        name, description, quantize_exported=lambda program, calibration, options: quantize_exported_qnn(
            name, program, calibration, options
        )
    )


for _s in (
    _scheme("qnn-16a4w", "QnnQuantizer PT2E: 16-bit activations, 4-bit weights in blocks of 32 (8-bit output "
                         "layer), calibrated"),
    _scheme("qnn-16a8w", "QnnQuantizer PT2E: 16-bit activations, 8-bit per-channel weights, calibrated"),
    _scheme("qnn-8a8w", "QnnQuantizer PT2E: 8-bit activations, 8-bit per-channel weights, calibrated"),
):
    SCHEMES.setdefault(_s.name, _s)
