"""Named quantization schemes. Each is a source transform applied in place to the exportable module
with torchao's quantize_, before torch.export."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class Scheme:
    """Either a source transform (`apply`, on the module before torch.export) or a PT2E flow
    (`quantize_exported`, on the ExportedProgram: prepare, calibrate, convert, export again)."""

    name: str
    description: str
    apply: Callable[[nn.Module, int], None] | None = None  # (module, group_size) -> None, in place
    default_group_size: int | None = None
    # (program, calibration inputs [(tokens, input_pos), ...], recipe options) -> quantized ExportedProgram
    quantize_exported: Callable | None = None


def _is_embedding(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Embedding)


def _is_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def quantize_embeddings(module: nn.Module, bits: int) -> None:
    """Per-row embeddings. ExecuTorch's quant fusion pass (to_executorch with
    do_quant_fusion_and_const_prop) rewrites torchao's dequantize_affine + embedding into
    quantized_decomposed::embedding_byte/embedding_4bit, which its quantized kernels run."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    dtype = {8: torch.int8, 4: torch.int4}[bits]
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=dtype, granularity=PerAxis(0)), filter_fn=_is_embedding)


def quantize_linears_8da4w(module: nn.Module, group_size: int) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    quantize_(module, config, filter_fn=_is_linear)


def _fp32(module: nn.Module, group_size: int) -> None:
    pass


def _8da4w(module: nn.Module, group_size: int) -> None:
    quantize_embeddings(module, 8)
    quantize_linears_8da4w(module, group_size)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("fp32", "no quantization", _fp32),
        Scheme(
            "8da4w",
            "int8 dynamic activations, int4 group-wise weights on linears; 8-bit embeddings",
            _8da4w,
            default_group_size=32,
        ),
    )
}


def apply_scheme(module: nn.Module, scheme: str, group_size: int | None = None) -> None:
    spec = SCHEMES[scheme]
    if spec.apply is not None:
        spec.apply(module, group_size or spec.default_group_size or 0)
