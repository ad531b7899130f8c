"""Named quantization schemes. Each is a source transform applied in place to the exportable module
with torchao's quantize_, before torch.export."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from models.errors import UserFacingError
from models.families import module_shape
from quant.algorithms import AFFINE, ALGORITHMS, PLAIN_ALGORITHM, SEARCH_QPARAMS, offered_algorithms, prepare_weights
from quant.gptq import apply_gptq
from quant.hqq import hqq_by_cache_sized_rows
from quant.mixed_precision import in_units
from quant.pt2e import quantize_pt2e


@dataclass(frozen=True)
class Scheme:
    """Either a source transform (`apply`, on the module before torch.export) or a PT2E flow
    (`quantize_exported`, on the ExportedProgram: prepare, calibrate, convert, export again)."""

    name: str
    description: str
    apply: Callable[[nn.Module, "QuantArgs"], None] | None = None  # in place
    default_group_size: int | None = None
    mixed_precision: bool = False  # takes the mixed_precision_budget option (8da8w layers)
    # (group size, qparams) -> the torchao config of its int4 linears, which a search quantizes its candidates
    # with; None: the scheme has no int4 weights an algorithm acts on
    int4_config: Callable | None = None
    # quant.pt2e.quantize_pt2e: (program, calibration inputs, the backend's quantizer factory, static tokens,
    # max_seq_len) -> (quantized ExportedProgram to lower, the converted module whose eager run simulates it)
    quantize_exported: Callable | None = None
    # `apply` may run on one piece of the model at a time (an embedding, a decoder layer, the output layer),
    # as the pieces are built: only one piece is then ever held in float. False: on the whole module.
    layerwise: bool = True
    # Bytes per weight of linears and of the embedding: as the quantized module holds them (torchao keeps int4
    # and int8 values in int8, plus a scale per group: bf16 for 8da4w, whose zero points are one shared 0, else
    # fp32 with an int8 zero point), and as a .pte stores them (int4 packed two to a byte with a bf16 scale per
    # group). For memory_estimate.py.
    module_bytes: tuple[float, float] = (4.0, 4.0)
    pte_bytes: tuple[float, float] = (4.0, 4.0)
    # The dtype the module is built in: its weights are read from the checkpoint straight into it, so a
    # half-precision scheme never holds an fp32 copy of the model.
    module_dtype: torch.dtype = torch.float32
    # int4 with one scale per output channel, not per group: GPTQ's integers are chosen group by group here
    # (quant/gptq.py), so the algorithms that choose integers are not offered.
    channelwise_int4: bool = False
    # Built and quantized in module_dtype, then cast whole to this dtype (quant.quantize.cast_quantized): an
    # algorithm's search (AWQ's) runs in fp32, which CPUs compute many times faster than fp16.
    cast_to: torch.dtype | None = None
    # False: `apply` takes a large weight whole (apply_scheme_by_rows), bounding its own memory, because how it
    # groups rows depends on the weight's row count.
    by_rows: bool = True

    @property
    def algorithms(self) -> tuple[str, ...]:
        """The quant_algorithm choices (quant/algorithms.py), the default first."""
        if self.int4_config is None:
            return (PLAIN_ALGORITHM,)
        offered = offered_algorithms(pt2e=self.quantize_exported is not None)
        if not self.channelwise_int4:
            return offered
        # minmax first: on a per-channel grid HQQ's scale fit (also AWQ's final qparams) measured worse than
        # min/max scales on the built-in model (docs/quantization.md)
        kept = tuple(a for a in offered if not ALGORITHMS[a].gptq_integers)
        return (PLAIN_ALGORITHM, *(a for a in kept if a != PLAIN_ALGORITHM))


@dataclass(frozen=True)
class QuantArgs:
    group_size: int = 0
    algorithm: str = PLAIN_ALGORITHM
    calibration: tuple = ()  # token windows [1, T] for calibrated algorithms
    units_8bit: tuple[str, ...] = ()  # decoder layers or the output layer, by name, whose linears stay at 8da8w


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


def _torchao_qparams(qparams: str):
    """torchao's IntxChooseQParamsAlgorithm of that value (quant.algorithms.AFFINE, HQQ_SCALE_ONLY)."""
    from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
        IntxChooseQParamsAlgorithm,
    )

    return IntxChooseQParamsAlgorithm(qparams)


# 8da4w's group scales are held in bf16, the precision its int4 kernels read them in: the integers are rounded
# against the scales the program will use, and the module's scales take half the bytes.
SCALE_DTYPE_8DA4W = torch.bfloat16


def config_8da4w(group_size: int, qparams: str = AFFINE):
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size),
                                                 intx_choose_qparams_algorithm=_torchao_qparams(qparams),
                                                 weight_scale_dtype=SCALE_DTYPE_8DA4W)


def config_8da8w():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis

    return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))


def int4_weight_with_scales(activation_quantization: str | None, scale_dtype: torch.dtype | None = None):
    """(weight on the int4 grid, its group scales, block size) -> torchao's int4 weight tensor with exactly those
    scales: how an algorithm that chooses the integers itself (GPTQ) ends in the tensor the others make.
    scale_dtype: the scales held in that dtype (GPTQ's are bf16 values already)."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    def make(weight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int]):
        tensor = IntxUnpackedToInt8Tensor.from_hp(
            weight, block_size, torch.int4, activation_quantization=activation_quantization,
            intx_choose_qparams_algorithm=None, custom_scale=scales,
            custom_zero_point=torch.zeros_like(scales, dtype=torch.int8))
        if scale_dtype is not None:
            tensor.scale = tensor.scale.to(scale_dtype)
        return tensor

    return make


def quantize_linears_8da4w(module: nn.Module, group_size: int, algorithm: str = PLAIN_ALGORITHM,
                           units_8bit: tuple[str, ...] = (), calibration: tuple = ()) -> None:
    """int4 linears, except those of `units_8bit` (module names, e.g. "model.layers.3", "lm_head"), which take
    8da8w."""
    from torchao.quantization import quantize_

    if units_8bit:
        quantize_(module, config_8da8w(), filter_fn=lambda m, fqn: _is_linear(m, fqn) and in_units(fqn, units_8bit))
    if ALGORITHMS[algorithm].gptq_integers:
        apply_gptq(module, list(calibration), group_size,
                   int4_weight_with_scales("int8_asym_per_token", SCALE_DTYPE_8DA4W))
    else:
        with hqq_by_cache_sized_rows():
            quantize_(module, config_8da4w(group_size, ALGORITHMS[algorithm].qparams),
                      filter_fn=lambda m, fqn: _is_linear(m, fqn) and not in_units(fqn, units_8bit))
    share_zero_points(module)


def share_zero_points(module: nn.Module) -> None:
    """Symmetric int4 groups all have zero point 0: each linear's zero points become one 0 seen through a
    broadcast view of their shape, not a byte per group. Every reader (torchao's dequantize, torch.export, a
    backend's partitioner) sees the same values."""
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    for m in module.modules():
        weight = getattr(m, "weight", None)
        if (isinstance(m, nn.Linear) and isinstance(weight, IntxUnpackedToInt8Tensor)
                and weight.zero_point.stride() != (0,) * weight.zero_point.dim() and not weight.zero_point.any()):
            zero = weight.zero_point
            weight.zero_point = torch.zeros((), dtype=zero.dtype, device=zero.device).expand(zero.shape)


def config_weight_only(bits: int, group_size: int | None, qparams: str = AFFINE):
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    granularity = PerGroup(group_size) if group_size else PerAxis(0)
    dtype = {8: torch.int8, 4: torch.int4}[bits]
    return IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity,
                                intx_choose_qparams_algorithm=_torchao_qparams(qparams))


def quantize_linears_weight_only(module: nn.Module, bits: int, group_size: int | None,
                                 algorithm: str = PLAIN_ALGORITHM, calibration: tuple = ()) -> None:
    """Weight-only linears (activations stay float): torchao leaves dequantize_affine + linear in the
    graph, for a backend that takes the pair whole and stores compressed weights (int4 block-wise, int8 per channel)."""
    from torchao.quantization import quantize_

    if ALGORITHMS[algorithm].gptq_integers:
        apply_gptq(module, list(calibration), group_size, int4_weight_with_scales(None))
        return
    with hqq_by_cache_sized_rows():
        quantize_(module, config_weight_only(bits, group_size, ALGORITHMS[algorithm].qparams), filter_fn=_is_linear)


def _int4_weight(module: nn.Module, args: QuantArgs) -> None:
    quantize_linears_weight_only(module, 4, args.group_size, args.algorithm, args.calibration)


def _int8_weight(module: nn.Module, args: QuantArgs) -> None:
    quantize_linears_weight_only(module, 8, None)


def _fp32(module: nn.Module, args: QuantArgs) -> None:
    pass


def _8da4w(module: nn.Module, args: QuantArgs) -> None:
    quantize_embeddings(module, 8)
    quantize_linears_8da4w(module, args.group_size, args.algorithm, args.units_8bit, args.calibration)


def _8da4w_emb4(module: nn.Module, args: QuantArgs) -> None:
    quantize_embeddings(module, 4)
    quantize_linears_8da4w(module, args.group_size, args.algorithm, args.units_8bit, args.calibration)


def _8da8w(module: nn.Module, args: QuantArgs) -> None:
    from torchao.quantization import quantize_

    quantize_embeddings(module, 8)
    quantize_(module, config_8da8w(), filter_fn=_is_linear)


def _c4w(module: nn.Module, args: QuantArgs) -> None:
    quantize_embeddings(module, 8)
    quantize_linears_weight_only(module, 4, None, args.algorithm)


# Output channels (weight rows) that share one k-means LUT, chosen by measurement on the built-in model
# (docs/quantization.md): one per channel scored nearest fp32 within 4.5 bits a weight. A linear whose rows
# it does not divide takes the largest divisor of both.
LUT_CHANNELS = 1


def quantize_linears_palettized(module: nn.Module, bits: int, channels: int = LUT_CHANNELS) -> None:
    """Weight-only linears as 2**bits-entry lookup tables (k-means, quant/palettize.py), one per `channels` output
    channels, and a `bits`-bit index per weight: torchao's codebook tensor, whose dequantize op a backend may
    take whole as a LUT decompression."""
    from quant.palettize import PalettizedTensor  # loads torchao's prototype codebook package, heavy

    code_dtype = getattr(torch, f"uint{bits}")
    for name, linear in [(n, m) for n, m in module.named_modules() if _is_linear(m, n)]:
        weight = linear.weight.detach()
        rows = math.gcd(channels, weight.shape[0])
        linear.weight = nn.Parameter(PalettizedTensor.from_float(weight, code_dtype, [rows, -1]), requires_grad=False)


def _p4w(module: nn.Module, args: QuantArgs) -> None:
    quantize_embeddings(module, 8)
    quantize_linears_palettized(module, 4, LUT_CHANNELS)


def _fp16(module: nn.Module, args: QuantArgs) -> None:
    # Built in fp16 already (module_dtype); the cast keeps a module or piece given in fp32 correct too.
    module.to(torch.float16)  # weights, rope tables and K/V caches alike; norms still compute in fp32


PT2E_INT4_BLOCK = 32

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("fp32", "no quantization", _fp32),
        Scheme(
            "8da4w",
            "int8 dynamic activations, int4 group-wise weights on linears; 8-bit embeddings",
            _8da4w,
            default_group_size=32,
            mixed_precision=True,
            int4_config=config_8da4w,
            module_bytes=(1 + 2 / 32, 1.0), pte_bytes=(0.5 + 2 / 32, 1.0),
        ),
        Scheme("int4-weight", "int4 weight-only linears, group-wise (block 32); float activations",
               _int4_weight, default_group_size=32,
               int4_config=lambda group_size, qparams: config_weight_only(4, group_size, qparams),
               module_bytes=(1 + 5 / 32, 4.0), pte_bytes=(0.5 + 2 / 32, 4.0)),
        Scheme("int8-weight", "int8 weight-only linears, per output channel; float activations", _int8_weight,
               module_bytes=(1.0, 4.0), pte_bytes=(1.0, 4.0)),
        Scheme("8da4w-emb4", "as 8da4w, with 4-bit embeddings", _8da4w_emb4, default_group_size=32,
               mixed_precision=True, int4_config=config_8da4w,
               module_bytes=(1 + 2 / 32, 1.0), pte_bytes=(0.5 + 2 / 32, 0.5)),
        Scheme("8da8w", "int8 dynamic activations, int8 per-channel weights on linears; 8-bit embeddings", _8da8w,
               module_bytes=(1.0, 1.0), pte_bytes=(1.0, 1.0)),
        # The Neural Engine's int4: one scale per output channel (it takes no block-wise int4), fp16 otherwise.
        Scheme("c4w", "int4 weight-only linears, per output channel; 8-bit embeddings; fp16 activations", _c4w,
               int4_config=lambda group_size, qparams: config_weight_only(4, None, qparams),
               module_bytes=(1.0, 1.0), pte_bytes=(0.5, 1.0), channelwise_int4=True, cast_to=torch.float16),
        # 4 bits as a LUT per group of output channels, for hardware that decompresses LUTs as it loads weights:
        # its k-means values follow each group's weights where c4w's grid is uniform.
        Scheme("p4w", "4-bit palettized linears: a 16-entry k-means LUT per output channel; "
               "8-bit embeddings; fp16 activations", _p4w,
               module_bytes=(1.0, 1.0), pte_bytes=(0.5, 1.0), cast_to=torch.float16, by_rows=False),
        Scheme("fp16", "fp16 weights, activations and K/V caches", _fp16, module_bytes=(2.0, 2.0),
               pte_bytes=(2.0, 2.0), module_dtype=torch.float16),
        # PT2E schemes: the lowering backend's quantizer decides the encodings of each bit width.
        # The backend's quantizer sets a PT2E scheme's qparams from its observers; what an algorithm can do
        # before it is transform the float weights: AWQ's scales, searched against symmetric int4 blocks of 32,
        # the weights the quantizer makes.
        Scheme("16a4w", "PT2E, calibrated: 16-bit activations, 4-bit weights in blocks of 32, 8-bit output layer",
               quantize_exported=quantize_pt2e, layerwise=False,
               int4_config=lambda group_size, qparams: config_weight_only(4, PT2E_INT4_BLOCK)),
        Scheme("16a8w", "PT2E, calibrated: 16-bit activations, 8-bit per-channel weights",
               quantize_exported=quantize_pt2e, layerwise=False),
        Scheme("8a8w", "PT2E, calibrated: 8-bit activations, 8-bit per-channel weights",
               quantize_exported=quantize_pt2e, layerwise=False),
    )
}


def quant_args(scheme: str, group_size: int | None = None, algorithm: str | None = None, calibration=(),
               units_8bit=()) -> QuantArgs:
    spec = SCHEMES[scheme]
    return QuantArgs(group_size or spec.default_group_size or 0, algorithm or spec.algorithms[0], tuple(calibration),
                     tuple(units_8bit))


def search_config(scheme: str, group_size: int | None = None):
    """The torchao config an algorithm's search (AWQ's) quantizes each candidate with: the scheme's int4 groups,
    min/max scales."""
    return SCHEMES[scheme].int4_config(quant_args(scheme, group_size).group_size, SEARCH_QPARAMS)


def prepare_for_scheme(module: nn.Module, scheme: str, args: QuantArgs) -> None:
    """The fp32 transform of the scheme's algorithm (AWQ's scales, SpinQuant's rotations), before quantize_."""
    if SCHEMES[scheme].int4_config is not None:
        prepare_weights(module, args.algorithm, search_config(scheme, args.group_size), args.calibration)


def apply_scheme(module: nn.Module, scheme: str, group_size: int | None = None, algorithm: str | None = None,
                 calibration=(), units_8bit=()) -> None:
    spec = SCHEMES[scheme]
    if spec.apply is not None:
        args = quant_args(scheme, group_size, algorithm, calibration, units_8bit)
        prepare_for_scheme(module, scheme, args)
        spec.apply(module, args)


def scheme_options(scheme: str) -> dict:
    """The recipe options a scheme takes, with their defaults."""
    spec = SCHEMES.get(scheme)
    if spec is None or len(spec.algorithms) == 1:
        return {}
    return {"quant_algorithm": spec.algorithms[0], **({"mixed_precision_budget": 0.0} if spec.mixed_precision else {})}


# Rows quantized at once by apply_scheme_by_rows: torchao's temporaries are about twice the fp32 weight it
# quantizes, which for a 128256-row output layer is more than all the decoder layers together.
ROWS_AT_ONCE = 8192


def apply_scheme_by_rows(module: nn.Module, scheme: str, group_size: int | None = None,
                         rows: int = ROWS_AT_ONCE, algorithm: str | None = None) -> None:
    """The scheme's torchao transform on one unit of a module (the algorithm's fp32 transform, if any, is the
    caller's: quant.quantize.UnitQuantizer), a block of rows at a time when `module` is one large Linear or
    Embedding. The schemes quantize each row on its own (groups and scales run along a row), so the result is
    the same tensor: torchao's row-major parts (qdata, scale, zero point) concatenated."""
    spec = SCHEMES[scheme]
    if spec.apply is None:
        return
    args = quant_args(scheme, group_size, algorithm)
    weight = getattr(module, "weight", None)
    lone = isinstance(module, (nn.Linear, nn.Embedding)) and getattr(module, "bias", None) is None
    if not lone or weight.shape[0] <= rows or not spec.layerwise or not spec.by_rows:
        spec.apply(module, args)
        return
    parts = []
    for start in range(0, weight.shape[0], rows):
        piece = _module_like(module, weight.data[start:start + rows])
        spec.apply(piece, args)
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


# Group sizes offered for group-wise schemes (block-wise int4 kernels and palettes take multiples of 32).
GROUP_SIZES = (32, 64, 128, 256)


def check_group_size(scheme: str, group_size: int | None) -> None:
    """Refuses a group size before the checkpoint is even loaded."""
    if group_size is None or SCHEMES[scheme].default_group_size is None:
        return
    if group_size not in GROUP_SIZES:
        raise UserFacingError(
            f"group size {group_size} is not offered for {scheme}; choose one of: {', '.join(map(str, GROUP_SIZES))}."
        )


def linear_input_dims(config) -> dict[str, int]:
    """Input width of every linear of a Llama, by role: what a weight group must divide."""
    shape = module_shape(config)
    return {"q/k/v/gate/up/lm_head": shape.hidden, "o_proj": shape.n_heads * shape.head_dim,
            "down_proj": shape.intermediate}


def check_group_size_fits(scheme: str, group_size: int | None, config) -> None:
    """Refuses, before quantizing, a group size that does not divide every linear's input width."""
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
