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
    # (program, calibration inputs [(tokens, input_pos), ...], recipe options)
    #   -> (quantized ExportedProgram to lower, the converted module whose eager run simulates it)
    quantize_exported: Callable | None = None
    # `apply` may run on one piece of the model at a time (an embedding, a decoder layer, the output layer),
    # as the pieces are built: only one piece is then ever held in float. False: on the whole module.
    layerwise: bool = True
    # Bytes per weight of linears and of the embedding: as the quantized module holds them (torchao keeps int4
    # and int8 values in int8, plus an fp32 scale and an int8 zero point per group), and as a .pte stores them
    # (int4 packed two to a byte with a bf16 scale per group). For memory_estimate.py.
    module_bytes: tuple[float, float] = (4.0, 4.0)
    pte_bytes: tuple[float, float] = (4.0, 4.0)


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


def quantize_linears_weight_only(module: nn.Module, bits: int, group_size: int | None) -> None:
    """Weight-only linears (activations stay float): torchao leaves dequantize_affine + linear in the
    graph, which Core ML takes whole and stores as compressed weights (int4 block-wise, int8 per channel)."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    granularity = PerGroup(group_size) if group_size else PerAxis(0)
    dtype = {8: torch.int8, 4: torch.int4}[bits]
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity), filter_fn=_is_linear)


def _int4_weight(module: nn.Module, group_size: int) -> None:
    quantize_linears_weight_only(module, 4, group_size)


def _int8_weight(module: nn.Module, group_size: int) -> None:
    quantize_linears_weight_only(module, 8, None)


def _fp32(module: nn.Module, group_size: int) -> None:
    pass


def _8da4w(module: nn.Module, group_size: int) -> None:
    quantize_embeddings(module, 8)
    quantize_linears_8da4w(module, group_size)


def _8da4w_emb4(module: nn.Module, group_size: int) -> None:
    quantize_embeddings(module, 4)
    quantize_linears_8da4w(module, group_size)


def _8da8w(module: nn.Module, group_size: int) -> None:
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    quantize_embeddings(module, 8)
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    quantize_(module, config, filter_fn=_is_linear)


def _fp16(module: nn.Module, group_size: int) -> None:
    module.to(torch.float16)  # weights, rope tables and K/V caches alike; norms still compute in fp32


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("fp32", "no quantization", _fp32),
        Scheme(
            "8da4w",
            "int8 dynamic activations, int4 group-wise weights on linears; 8-bit embeddings",
            _8da4w,
            default_group_size=32,
            module_bytes=(1 + 5 / 32, 1.0), pte_bytes=(0.5 + 2 / 32, 1.0),
        ),
        Scheme("int4-weight", "int4 weight-only linears, group-wise (block 32); float activations",
               _int4_weight, default_group_size=32, module_bytes=(1 + 5 / 32, 4.0), pte_bytes=(0.5 + 2 / 32, 4.0)),
        Scheme("int8-weight", "int8 weight-only linears, per output channel; float activations", _int8_weight,
               module_bytes=(1.0, 4.0), pte_bytes=(1.0, 4.0)),
        Scheme("8da4w-emb4", "as 8da4w, with 4-bit embeddings", _8da4w_emb4, default_group_size=32,
               module_bytes=(1 + 5 / 32, 1.0), pte_bytes=(0.5 + 2 / 32, 0.5)),
        Scheme("8da8w", "int8 dynamic activations, int8 per-channel weights on linears; 8-bit embeddings", _8da8w,
               module_bytes=(1.0, 1.0), pte_bytes=(1.0, 1.0)),
        # the cast also takes the module's own rope tables, outside every piece
        Scheme("fp16", "fp16 cast of weights, activations and K/V caches", _fp16, layerwise=False,
               module_bytes=(2.0, 2.0), pte_bytes=(2.0, 2.0)),
    )
}


def apply_scheme(module: nn.Module, scheme: str, group_size: int | None = None) -> None:
    spec = SCHEMES[scheme]
    if spec.apply is not None:
        spec.apply(module, group_size or spec.default_group_size or 0)


# Rows quantized at once by apply_scheme_by_rows: torchao's temporaries are about twice the fp32 weight it
# quantizes, which for a 128256-row output layer is more than all the decoder layers together.
ROWS_AT_ONCE = 8192


def apply_scheme_by_rows(module: nn.Module, scheme: str, group_size: int | None = None,
                         rows: int = ROWS_AT_ONCE) -> None:
    """apply_scheme, a block of rows at a time when `module` is one large Linear or Embedding. The schemes
    quantize each row on its own (groups and scales run along a row), so the result is the same tensor:
    torchao's row-major parts (qdata, scale, zero point) concatenated."""
    weight = getattr(module, "weight", None)
    lone = isinstance(module, (nn.Linear, nn.Embedding)) and getattr(module, "bias", None) is None
    if not lone or weight.shape[0] <= rows or not SCHEMES[scheme].layerwise:
        apply_scheme(module, scheme, group_size)
        return
    parts = []
    for start in range(0, weight.shape[0], rows):
        piece = _module_like(module, weight.data[start:start + rows])
        apply_scheme(piece, scheme, group_size)
        parts.append(piece.weight.data)
    if type(parts[0]) is torch.Tensor:
        if parts[0].dtype == weight.dtype:
            return  # the scheme leaves this module as it is
        joined = torch.cat(parts)
    else:
        names, context = parts[0].__tensor_flatten__()
        inner = {name: torch.cat([getattr(p, name) for p in parts]) for name in names}
        joined = type(parts[0]).__tensor_unflatten__(inner, context, weight.shape, None)
    del parts
    module.weight = nn.Parameter(joined, requires_grad=False)


def _module_like(module: nn.Module, weight: torch.Tensor) -> nn.Module:
    with torch.device("meta"):
        piece = (nn.Linear(weight.shape[1], weight.shape[0], bias=False) if isinstance(module, nn.Linear)
                 else nn.Embedding(weight.shape[0], weight.shape[1]))
    piece.weight = nn.Parameter(weight, requires_grad=False)
    return piece


# Group sizes offered for group-wise schemes (XNNPACK's block-wise int4 kernels and Core ML's
# block-wise palettes take multiples of 32).
GROUP_SIZES = (32, 64, 128, 256)


def check_group_size(scheme: str, group_size: int | None) -> None:
    """Refuses a group size before the checkpoint is even loaded."""
    from errors import UserFacingError

    if group_size is None or SCHEMES[scheme].default_group_size is None:
        return
    if group_size not in GROUP_SIZES:
        raise UserFacingError(
            f"group size {group_size} is not offered for {scheme}; choose one of: {', '.join(map(str, GROUP_SIZES))}."
        )


def linear_input_dims(config) -> dict[str, int]:
    """Input width of every linear of a Llama, by role: what a weight group must divide."""
    from models.llama import LlamaShape

    shape = LlamaShape.from_config(config)
    return {"q/k/v/gate/up/lm_head": shape.hidden, "o_proj": shape.n_heads * shape.head_dim,
            "down_proj": shape.intermediate}


def check_group_size_fits(scheme: str, group_size: int | None, config) -> None:
    """Refuses, before quantizing, a group size that does not divide every linear's input width."""
    from errors import UserFacingError

    spec = SCHEMES[scheme]
    if spec.default_group_size is None:
        return
    group_size = group_size or spec.default_group_size
    dims = linear_input_dims(config)
    misfits = {role: dim for role, dim in dims.items() if dim % group_size}
    if misfits:
        fitting = [g for g in GROUP_SIZES if all(dim % g == 0 for dim in dims.values())]
        raise UserFacingError(
            f"group size {group_size} does not divide the input width of "
            + ", ".join(f"{role} ({dim})" for role, dim in misfits.items())
            + f" for {scheme}; choose one of: {', '.join(map(str, fitting)) or 'none: pick a per-channel scheme'}."
        )
