"""AWQ's activation-aware scales, one decoder layer at a time: torchao's candidates (the inputs' mean magnitude to
the power i / 20), searched on plain tensors with the numbers of the torchao config that quantizes them (FAST), or
by torchao.prototype.awq's AWQObserver itself (EXHAUSTIVE).

A layer's scales come from the inputs its linears see on the calibration text; folding them into the op
before each linear leaves the layer's function as it was, so the hidden states a layer passes on are the
float model's whether its scales are folded yet or not. A layer can therefore be searched as soon as it is
built and before it is quantized, from the hidden states the layers before it passed on: the whole float
model is never needed (AwqAsBuilt), and a whole float module gets the same scales layer by layer (apply_awq).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

AWQ_SCALE_CANDIDATES = 20  # torchao's default search space
# What AwqAsBuilt's search on a decoder layer holds beside the float layer, in fp32 copies of the linears reading
# the layer's widest input (gate and up together). The FAST plan reads the rows where they are and holds blocks of
# them, the outputs of gate and up, a bf16 copy of down_proj, the kept calibration tokens and the layer's
# activations: under two copies at Llama-3.2-1B's and 3.1-8B's shapes (`python -m bench.awq_search memory <shape>`).
# EXHAUSTIVE (torchao's observer, about thirteen copies) is a bench plan, not a job's.
AWQ_SEARCH_COPIES = 2


def layer_linears(layer) -> dict[str, list[nn.Linear]]:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    return {"attention_in": qkv, "mlp_in": [mlp.gate_proj, mlp.up_proj], "mlp_out": [mlp.down_proj]}


# The transforms below give the parameters new tensors (`.data =`) and change none in place: the module's
# weights are the loaded checkpoint's own tensors, which the fp32 reference and the other recipes still read.


@torch.no_grad()
def fold_input_scale(owner: nn.Module, linears: list[nn.Linear], scale: torch.Tensor) -> None:
    """x -> x / scale in the op that makes the linears' input (a norm's weight, or up_proj's rows for
    down_proj), and W -> W * scale in the linears: the same function, one op fewer than a runtime multiply."""
    if isinstance(owner, nn.Linear):
        owner.weight.data = owner.weight / scale[:, None]
        if owner.bias is not None:
            owner.bias.data = owner.bias / scale
    else:
        owner.weight.data = owner.weight / scale
    for linear in linears:
        linear.weight.data = linear.weight * scale[None, :]


def layer_scale_owners(layer) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """(op that makes the input, linears reading it) for every input of a decoder layer AWQ can scale without
    a new op. o_proj's input comes out of attention: its channels fold into v_proj only without grouped KV
    heads, so it is left."""
    linears = layer_linears(layer)
    return [(layer.input_layernorm, linears["attention_in"]),
            (layer.post_attention_layernorm, linears["mlp_in"]),
            (layer.mlp.up_proj, linears["mlp_out"])]


def _clear_cache(layer) -> None:
    layer.self_attn.k_cache.zero_()
    layer.self_attn.v_cache.zero_()


@dataclass(frozen=True)
class SearchPlan:
    """How a decoder layer's scales are searched. Every plan picks among the same candidates, ratio i / 20 of the
    inputs' mean magnitude; `exhaustive` is torchao's AWQObserver, which quantizes every candidate with the torchao
    config and scores it on every calibration token, each linear group on its own output."""

    exhaustive: bool = False
    # candidates are scored on every token_stride-th calibration token (the mean magnitude reads all of them)
    token_stride: int = 4
    # grid steps between the candidates scored first; then halved around the best until 1 (1: every candidate)
    coarse_step: int = 4
    # gate and up scored on the MLP's output (down_proj in float) rather than on their own outputs
    mlp_block: bool = True
    # the candidates' products in bf16 where the CPU multiplies bf16 natively (product_dtype()): the quantized
    # weights and the group scales are fp32's, and a product's rounding is far below the int4 error it scores
    bf16_products: bool = True

    def product_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16_products and native_bf16_products() else torch.float32


FAST = SearchPlan()
EXHAUSTIVE = SearchPlan(exhaustive=True, token_stride=1, coarse_step=1, mlp_block=False, bf16_products=False)


def native_bf16_products() -> bool:
    """Whether the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX): elsewhere a bf16 matmul is
    emulated and slower than fp32's."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def search_products(plan: SearchPlan = FAST) -> str:
    """What a report says the search's products were computed in."""
    return "bf16" if plan.product_dtype() == torch.bfloat16 else "fp32"


@torch.no_grad()
def search_layer(layer, states: list[torch.Tensor], arguments: list[tuple], weight_config,
                 plan: SearchPlan = FAST) -> list[torch.Tensor]:
    """Searches and folds AWQ's scales for one float decoder layer, one scale per input shared by several linears
    (scored together, as one linear of all their rows: AWQ searches one scale per input), from `states`, the
    hidden states entering it (one per calibration window, each called with its `arguments`). Returns the states
    leaving it."""
    groups = layer_scale_owners(layer)
    if plan.exhaustive:
        from torchao.prototype.awq.core import AWQObserver  # torchao's prototype is read only by this plan

        observers = [AWQObserver(torch.cat([l.weight for l in linears]), None, weight_config, AWQ_SCALE_CANDIDATES)
                     for _owner, linears in groups]
    else:
        observers = [InputStatistics(plan.token_stride) for _group in groups]
    hooks = [linears[0].register_forward_pre_hook(lambda m, args, obs=obs: obs(args[0], None))
             for obs, (_owner, linears) in zip(observers, groups)]
    leaving = []
    try:
        for x, args in zip(states, arguments):
            _clear_cache(layer)
            leaving.append(layer(x, *args))
    finally:
        for hook in hooks:
            hook.remove()
        _clear_cache(layer)
    for index, ((owner, linears), observer) in enumerate(zip(groups, observers)):
        if plan.exhaustive:
            scale = observer.calculate_qparams().to(torch.float32)
        else:
            after = layer.mlp.down_proj if plan.mlp_block and linears == layer_linears(layer)["mlp_in"] else None
            scale = search_scale([l.weight for l in linears], observer,
                                 CandidateQuantizer(weight_config, plan.product_dtype()), plan, after)
        fold_input_scale(owner, linears, scale)
    return leaving


class InputStatistics:
    """What the fast search keeps of a linear group's input: each channel's mean magnitude over every token (a
    running sum), and every `stride`-th token to score candidates on."""

    def __init__(self, stride: int):
        self.stride = stride
        self.magnitude_sum: torch.Tensor | None = None
        self.tokens = 0
        self.kept: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, _output) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        total = x.abs().sum(0)
        self.magnitude_sum = total if self.magnitude_sum is None else self.magnitude_sum + total
        self.tokens += x.shape[0]
        self.kept.append(x[::self.stride].clone())

    @property
    def mean_magnitude(self) -> torch.Tensor:
        return self.magnitude_sum / self.tokens

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.kept)


# The bytes of a weight's rows quantized at once while scoring a candidate: few enough that the passes over them
# stay in the CPU's cache, rows enough that the product reading them runs at the matmul's full speed.
BLOCK_BYTES = 4 << 20


class CandidateQuantizer:
    """The quantize-dequantize a torchao int4 config applies to a linear (symmetric groups, min/max scales, and
    for the 8da4w configs int8 per-token activations), written on plain fp32 tensors: a candidate is scored with
    one matmul, without building torchao's tensor subclass."""

    def __init__(self, config, product_dtype: torch.dtype = torch.float32):
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.quant_primitives import MappingType

        mapping = getattr(config, "weight_mapping_type", getattr(config, "mapping_type", None))
        granularity = getattr(config, "weight_granularity", getattr(config, "granularity", None))
        if config.weight_dtype != torch.int4 or mapping != MappingType.SYMMETRIC:
            raise ValueError(f"the fast AWQ search quantizes symmetric int4 groups, not {config}")
        self.group = granularity.group_size if isinstance(granularity, PerGroup) else None
        self.activations_int8 = isinstance(config, Int8DynamicActivationIntxWeightConfig)
        # the dtype the config holds its group scales in: the integers are rounded against those scales
        self.scale_dtype = getattr(config, "weight_scale_dtype", None) or torch.float32
        self.product_dtype = product_dtype

    def weight(self, w: torch.Tensor, out: torch.Tensor | None = None,
               magnitudes: torch.Tensor | None = None) -> torch.Tensor:
        """w quantized to int4 groups and back, in fp32 and in place (w is a scratch tensor); the last multiply
        written to `out` (of w's shape, in any float dtype) when given, the magnitudes to `magnitudes` (fp32)."""
        rows, columns = w.shape
        groups = w.view(rows, -1, self.group or columns)
        # a group's largest magnitude is max(high, -low), and found several times faster than aminmax's pair
        magnitude = torch.abs(groups, out=None if magnitudes is None else magnitudes.view(groups.shape))
        scale = magnitude.amax(dim=-1, keepdim=True).div_(7.5).clamp_(min=torch.finfo(torch.float32).eps)
        if self.scale_dtype != torch.float32:
            # held in the config's dtype, whose reciprocal torchao's quantize_affine also takes in that dtype
            held = scale.to(self.scale_dtype)
            reciprocal, scale = (1.0 / held).float(), held.float()
        else:
            reciprocal = 1.0 / scale
        # times the reciprocal, as torchao's quantize_affine: a group's extreme lands on -7, not -8
        integers = groups.mul_(reciprocal).round_().clamp_(-8, 7)
        if out is None:
            return integers.mul_(scale).view(rows, columns)
        return torch.mul(integers, scale, out=out.view(groups.shape)).view(rows, columns)

    def split(self, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float output [out, tokens] as error() subtracts it: its part in the product dtype, and in fp32 what
        that part leaves out (None in fp32)."""
        leading = reference.to(self.product_dtype)
        return leading, None if leading is reference else reference - leading.float()

    def error(self, weights: list[torch.Tensor], scale: torch.Tensor, x: torch.Tensor,
              reference: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """x / scale through the quantized weights * scale, their rows one after the other and transposed ([out,
        tokens]), less the float output (`reference`, split() once for every candidate), in fp32. A block of rows
        at a time, each quantized in a scratch tensor the CPU's cache holds through the passes and the product that
        reads it. In bf16 the reference's bf16 part is subtracted inside the product (its sum is fp32's) and the
        rest after, so the rounding is the error's own, not the output's."""
        leading, remainder = reference
        x = self.activations(x / scale).T.to(self.product_dtype).contiguous()
        columns = weights[0].shape[1]
        rows_at_once = max(1, BLOCK_BYTES // (4 * columns))
        scratch = torch.empty(min(rows_at_once, max(w.shape[0] for w in weights)), columns)
        magnitudes = torch.empty_like(scratch)
        narrow = None if self.product_dtype == torch.float32 else torch.empty_like(scratch, dtype=self.product_dtype)
        error = torch.empty_like(leading)
        written = 0
        for weight in weights:
            for start in range(0, weight.shape[0], rows_at_once):
                rows = weight[start:start + rows_at_once].shape[0]
                w = self.weight(torch.mul(weight[start:start + rows], scale, out=scratch[:rows]),
                                None if narrow is None else narrow[:rows], magnitudes[:rows])
                block = slice(written, written + rows)
                torch.addmm(leading[block], w, x, beta=-1, out=error[block])
                written += rows
        return error if remainder is None else error.float().sub_(remainder)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """x as the 8da4w kernels see it: int8 per token, asymmetric; unchanged for weight-only configs."""
        if not self.activations_int8:
            return x
        low = x.amin(-1, keepdim=True).clamp(max=0)
        high = x.amax(-1, keepdim=True).clamp(min=0)
        scale = ((high - low) / 255).clamp(min=torch.finfo(torch.float32).eps)
        zero = (-128 - torch.round(low / scale)).clamp(-128, 127)
        # times the reciprocal, as torchao's quantize_affine, so a value on a rounding boundary rounds alike
        return ((torch.round(x * (1.0 / scale)) + zero).clamp(-128, 127) - zero) * scale


def candidate_scale(mean_magnitude: torch.Tensor, index: int) -> torch.Tensor:
    """torchao's candidate `index`: the mean magnitude to the power index / 20, normalised to a geometric mean of
    its extremes of 1."""
    scale = mean_magnitude.pow(index / AWQ_SCALE_CANDIDATES).clamp(min=1e-4)
    return scale / (scale.max() * scale.min()).sqrt()


# Losses closer than this (relative) are a tie, won by the smaller exponent: in bf16 the products round each weight
# and input to 8 significant bits, which moves a loss by about this much (in fp32, python's min: the first).
TIE_TOLERANCE = {torch.bfloat16: 2 ** -10, torch.float32: 0.0}


def _mlp_hidden(output: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from gate and up's output [out, tokens], as [tokens, intermediate]."""
    gate, up = output.T.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@torch.no_grad()
def search_scale(weights: list[torch.Tensor], inputs: InputStatistics, quantizer: CandidateQuantizer,
                 plan: SearchPlan, after: nn.Linear | None = None) -> torch.Tensor:
    """The candidate scale whose quantized linear group (the rows of `weights`, which read the same input) is
    closest, in mean squared error, to the float one on the kept tokens; with `after` (down_proj for gate and up),
    on the MLP's output instead of the group's own."""
    x = inputs.sample
    weights = [w.float() for w in weights]
    output = torch.cat([w @ x.T for w in weights])  # the unscaled float output, once for every candidate
    reference = quantizer.split(output)
    if after is not None:
        # down_proj in the candidates' product dtype, as their own products: a copy a quarter of gate and up's
        after_weight = after.weight.to(quantizer.product_dtype)
        hidden = _mlp_hidden(output)
    losses: dict[int, float] = {}

    def loss(index: int) -> float:
        if index not in losses:
            error = quantizer.error(weights, candidate_scale(inputs.mean_magnitude, index), x, reference)
            if after is not None:  # down_proj is linear: its output's error is its product with the hidden's
                error = (_mlp_hidden(output + error) - hidden).to(after_weight.dtype) @ after_weight.T
            losses[index] = error.float().pow(2).mean().item()
        return losses[index]

    tolerance = TIE_TOLERANCE[quantizer.product_dtype]

    def lowest(indices) -> int:
        """The index of the lowest loss, the smaller index where two are within the products' precision."""
        best = None
        for index in indices:
            if best is None or loss(index) < loss(best) * (1 - tolerance):
                best = index
        return best

    best = lowest(range(0, AWQ_SCALE_CANDIDATES, plan.coarse_step))
    step = plan.coarse_step // 2
    while step >= 1:
        best = lowest(i for i in (best - step, best, best + step) if 0 <= i < AWQ_SCALE_CANDIDATES)
        step //= 2
    return candidate_scale(inputs.mean_magnitude, best)


def _entering_first_layer(module, windows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple]]:
    """The hidden states entering the first decoder layer, and each window's layer arguments (one per window
    length: the windows all start at position 0)."""
    states = [module.model.embed_tokens(tokens) for tokens in windows]
    by_length: dict[int, tuple] = {}
    for tokens, x in zip(windows, states):
        if tokens.shape[1] not in by_length:
            by_length[tokens.shape[1]] = module.layer_arguments(tokens.shape[1], torch.tensor([0]), x.dtype)
    return states, [by_length[tokens.shape[1]] for tokens in windows]


@torch.no_grad()
def apply_awq(module, weight_config, windows: list[torch.Tensor], plan: SearchPlan = FAST) -> None:
    """AWQ's scales folded into every decoder layer of a float module, from the calibration `windows`. The
    output layer (vocabulary-wide, its input the final norm's) is left to the scheme's qparams."""
    states, arguments = _entering_first_layer(module, windows)
    for layer in module.model.layers:
        states = search_layer(layer, states, arguments, weight_config, plan)


class AwqAsBuilt:
    """apply_awq on a module models.llama.build_exportable is filling, called on each unit as it is filled and
    before it is quantized (transform_unit): the float embedding makes the calibration text's hidden states,
    and each float decoder layer has its scales searched and folded from the states entering it and passes on
    the states leaving it. Only one float decoder layer and the states are held: the scales are apply_awq's."""

    def __init__(self, weight_config, windows: list[torch.Tensor], plan: SearchPlan = FAST):
        self.weight_config = weight_config
        self.windows = windows
        self.plan = plan
        self.states: list[torch.Tensor] | None = None
        self.arguments: list[tuple] = []

    @torch.no_grad()
    def __call__(self, unit: nn.Module, module) -> None:
        if unit is module.model.embed_tokens:
            self.states, self.arguments = _entering_first_layer(module, self.windows)
        elif any(unit is layer for layer in module.model.layers):
            if self.states is None:
                raise ValueError("AWQ by unit needs the embedding filled before the first decoder layer")
            self.states = search_layer(unit, self.states, self.arguments, self.weight_config, self.plan)
            if unit is module.model.layers[-1]:
                self.states = None  # the states leaving the last layer are no longer needed
