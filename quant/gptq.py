"""GPTQ (Frantar et al., 2022, arXiv:2210.17323, Algorithm 1) for int4 group-wise linears, on the CPU.

torchao 0.18's GPTQ loop asserts a CUDA device and writes mslk's asymmetric Int4Tensor, which ExecuTorch's backends
do not take; the loop below quantizes to the symmetric int4 groups every other algorithm makes, ending in the same
torchao tensor (IntxUnpackedToInt8Tensor with the group scales given), so the program and its bytes per token are
those of minmax. Its Hessians, 2 XᵀX of a linear's inputs on the calibration text, are summed as torchao's GPTQ
observer sums them (a test compares the two).

The decoder layers are quantized in order, then the output layer. Inside a layer the linears go in the order its
forward calls them ("true sequential"): the linears that read one input (q/k/v, gate/up) share one Hessian and are
quantized as one matrix (one Cholesky), on the inputs the layer's already quantized linears make; the same passes
give the quantized layer's outputs, the next layer's inputs. Columns go in order of decreasing Hessian diagonal
("act order"), their errors propagated 128 columns at a time (lazy batch updates); each group's scale is fixed
beforehand from the float weights, by the clipping of the group's maximum that gives the least squared error
(GPTQ's reference quantizer's search), so reordering the columns never mixes groups. Once the integers are chosen,
each row's group scales are solved again for them against the same Hessian (refit_scales): the loop chose the
integers for scales fitted to the weights alone.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# Calibration tokens GPTQ's Hessians are taken over, more than quant.calibration's default (which AWQ's search
# and the mixed-precision search keep to). The Hessians are as wide as the MLP: on a few thousand tokens they are
# near singular and GPTQ fits the calibration text (docs/quantization.md).
GPTQ_CALIBRATION_TOKENS = 8192
# Added to the Hessian's diagonal, as a fraction of its mean. Over GPTQ_CALIBRATION_TOKENS the usual 1 % still
# fits them more than the evaluation texts, and 10 % holds the loop back (measured on the built-in model,
# docs/quantization.md).
DAMPING = 0.03
# Columns whose errors are propagated to the rest of the matrix at once (the paper's lazy batch updates).
BLOCK = 128
# Rows of a Hessian's upper triangle summed by one product (half the work of the whole square when it is wide)
HESSIAN_BLOCK = 512
# Clipping factors of a group's maximum tried for its scale, from CLIP_LOW to 1.
CLIP_STEPS, CLIP_LOW = 40, 0.5
QMIN, QMAX = -8, 7  # torch.int4, symmetric: the groups every int4 scheme here makes


def group_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """[rows, columns // group_size] scales: per group the clipped maximum / 7.5 with the least squared
    error, rounded to bf16, the precision a .pte stores them in."""
    groups = weight.view(weight.shape[0], -1, group_size)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-9)
    best = best_error = None
    for step in range(CLIP_STEPS + 1):
        scale = amax * (CLIP_LOW + (1 - CLIP_LOW) * step / CLIP_STEPS) / (-QMIN - 0.5)
        error = ((groups / scale).round().clamp(QMIN, QMAX) * scale - groups).pow(2).sum(-1, keepdim=True)
        if best is None:
            best, best_error = scale, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, scale, best), torch.where(better, error, best_error)
    return best.squeeze(-1).to(torch.bfloat16).to(torch.float32)


@torch.no_grad()
def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, group_size: int,
                damping: float = DAMPING) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-8, 7] [rows, columns], scales [rows, columns // group_size]) minimizing
    ||X Wᵀ - X Qᵀ||² for the inputs X whose `hessian` is given, column by column. The loop runs on Wᵀ, so that
    each column it rounds and each update it makes is a contiguous row."""
    dead = torch.diag(hessian) == 0  # an input that is always zero: any value of its column will do
    hessian = _damped(hessian, damping)
    columns = weight.shape[1]
    scales = group_scales(weight.to(torch.float32).masked_fill(dead, 0), group_size)
    order = torch.argsort(torch.diag(hessian), descending=True)
    group_of = (order // group_size).tolist()
    scales_t = scales.t().contiguous()  # [groups, rows]
    # a copy, columns as rows: the caller's weight stays
    weight_t = weight.to(torch.float32).masked_fill(dead, 0)[:, order].t().contiguous()
    hessian = hessian[order][:, order]
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    values_t = torch.empty_like(weight_t, dtype=torch.int8)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = weight_t[start:end]
        errors = torch.empty_like(block)
        block_inverse = inverse[start:end, start:end]
        for j in range(end - start):
            column, scale = block[j], scales_t[group_of[start + j]]
            q = (column / scale).round_().clamp_(QMIN, QMAX)
            values_t[start + j] = q
            error = errors[j]
            torch.sub(column, q.mul_(scale), out=error).div_(block_inverse[j, j])
            block[j + 1:].addr_(block_inverse[j, j + 1:], error, alpha=-1)
        weight_t[end:].addmm_(inverse[start:end, end:].t(), errors, alpha=-1)
    return values_t.t()[:, torch.argsort(order)].contiguous(), scales


def _damped(hessian: torch.Tensor, damping: float) -> torch.Tensor:
    hessian = hessian.to(torch.float32, copy=True)
    dead = torch.diag(hessian) == 0
    hessian[dead, dead] = 1
    hessian.diagonal().add_(damping * torch.mean(torch.diag(hessian)))
    return hessian


def _row_errors(weight: torch.Tensor, hessian: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """Per row, (w - q·s) H (w - q·s)ᵀ: the row's share of ||X Wᵀ - X Qᵀ||²."""
    rows = values.shape[0]
    error = weight - (values.to(torch.float32).view(rows, -1, group_size) * scales[..., None]).view(rows, -1)
    return ((error @ hessian) * error).sum(-1)


@torch.no_grad()
def refit_scales(weight: torch.Tensor, hessian: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                 group_size: int, damping: float = DAMPING) -> torch.Tensor:
    """For the integers `values`, each row's group scales s minimizing (w - q·s) H (w - q·s)ᵀ, the least-squares
    system A s = b with A[g, h] = Σ q_i H_ij q_j (i in group g, j in group h) and b[g] = Σ q_i (H w)_i, rounded
    to bf16. A row keeps its given scales where the refit is no better or a solved scale is not positive."""
    dead = torch.diag(hessian) == 0
    hessian = _damped(hessian, damping)
    weight = weight.to(torch.float32).masked_fill(dead, 0)  # as gptq_weight quantized it
    q = values.to(torch.float32)
    rows, columns = q.shape
    groups = columns // group_size
    a = torch.empty(rows, groups, groups)
    for g in range(groups):  # every row's A[g, h] for h >= g at once: (q_g H_g,h) ⊙ q_h, summed by group; A is symmetric
        columns_g, rest = slice(g * group_size, (g + 1) * group_size), slice(g * group_size, columns)
        a[:, g, g:] = ((q[:, columns_g] @ hessian[columns_g, rest]) * q[:, rest]).view(rows, groups - g, group_size).sum(-1)
        a[:, g + 1:, g] = a[:, g, g + 1:]
    b = (q * (weight @ hessian)).view(rows, groups, group_size).sum(-1)
    # A group whose integers are all zero leaves its row of A empty: a small pull to the given scale.
    ridge = 1e-6 * a.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True).clamp(min=1e-12)
    solved = torch.linalg.solve(a + torch.diag_embed(ridge.expand(rows, groups)),
                                (b + ridge * scales).unsqueeze(-1)).squeeze(-1)
    refitted = solved.to(torch.bfloat16).to(torch.float32)
    # A row's error is w H wᵀ - 2 s·b + sᵀ A s: the first term is the same for both scales
    better = (refitted > 0).all(-1) & (_error_beyond_weight(a, b, refitted) < _error_beyond_weight(a, b, scales))
    return torch.where(better[:, None], refitted, scales)


def _error_beyond_weight(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per row, sᵀ A s - 2 s·b, in float64: a row's error less its w H wᵀ, a difference of nearly equal terms."""
    s, a, b = scales.double(), a.double(), b.double()
    return (torch.einsum("rg,rgh,rh->r", s, a, s) - 2 * (s * b).sum(-1))


class _InputReached(Exception):
    pass


@torch.no_grad()
def _first_layer_inputs(module, windows: list[torch.Tensor]) -> list[tuple]:
    """The arguments decoder layer 0 is called with, one tuple per calibration window."""
    captured = []

    def stop(_layer, args):
        captured.append(args)
        raise _InputReached

    hook = module.model.layers[0].register_forward_pre_hook(stop)
    try:
        for tokens in windows:
            try:
                module(tokens, torch.tensor([0]))
            except _InputReached:
                pass
    finally:
        hook.remove()
    return captured


def _float_linears(unit: nn.Module) -> list[nn.Linear]:
    """The unit's linears still in float (those of a unit kept at 8 bits are quantized already)."""
    return [m for m in unit.modules() if isinstance(m, nn.Linear) and type(m.weight.data) is torch.Tensor]


class _Hessian:
    """2 XᵀX / calls over the inputs X it is given, as torchao's GPTQ observer sums it, one block row of its upper
    triangle at a time: the lower one is its mirror."""

    def __init__(self, width: int):
        self.sum, self.calls = torch.zeros(width, width), 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        width = x.shape[1]
        for start in range(0, width, HESSIAN_BLOCK):
            end = min(start + HESSIAN_BLOCK, width)
            self.sum[start:end, start:].addmm_(x[:, start:end].t(), x[:, start:])
        self.calls += 1

    def value(self) -> torch.Tensor:
        upper = self.sum.triu()
        return (upper + upper.triu(1).t()) * (2 / self.calls)


def _input_groups(layer: nn.Module, x: torch.Tensor, arguments: tuple) -> list[list[nn.Linear]]:
    """The layer's float linears in the order its forward calls them, those that read the same input (q/k/v,
    gate/up) in one group, found by running one calibration window."""
    called = []
    hooks = [linear.register_forward_pre_hook(lambda m, args: called.append((m, args[0])))
             for linear in _float_linears(layer)]
    try:
        _clear_cache(layer)
        layer(x, *arguments)
    finally:
        for hook in hooks:
            hook.remove()
    groups, last_input = [], None
    for linear, x in called:
        if x is last_input:
            groups[-1].append(linear)
        else:
            groups.append([linear])
        last_input = x
    return groups


def _clear_cache(layer: nn.Module) -> None:
    for name, buffer in layer.named_buffers():
        if name.rsplit(".", 1)[-1].startswith(("k_cache", "v_cache")):
            buffer.zero_()


@torch.no_grad()
def _quantize(linears: list[nn.Linear], hessian: torch.Tensor, group_size: int,
              int4_weight: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]) -> None:
    """GPTQ on linears that read the same input, as one linear of all their rows: one Hessian, one Cholesky."""
    weight = torch.cat([linear.weight.data.to(torch.float32) for linear in linears])
    values, scales = gptq_weight(weight, hessian, group_size)
    scales = refit_scales(weight, hessian, values, scales, group_size)
    del weight
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.weight.shape[0])
        start = rows.stop
        grid = values[rows].to(torch.float32).view(rows.stop - rows.start, -1, group_size) * scales[rows, :, None]
        linear.weight = nn.Parameter(int4_weight(grid.view(-1, values.shape[1]), scales[rows].contiguous(),
                                                 (1, group_size)), requires_grad=False)


@torch.no_grad()
def quantize_layer(layer: nn.Module, hidden: list[torch.Tensor], arguments: list[tuple], group_size: int,
                   int4_weight: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]
                   ) -> list[torch.Tensor]:
    """GPTQ on one decoder layer, its linears in the order they are called ("true sequential"): each group's
    Hessian is taken on the inputs the layer's already quantized linears make. Returns the quantized layer's
    outputs, the next layer's inputs. A quantized linear's output for each window is computed once and replayed
    in the passes after it, so the layer's linears run once per window in all."""
    groups = _input_groups(layer, hidden[0], arguments[0]) if _float_linears(layer) else []
    window = [0]

    def replayed(forward):
        outputs = []

        def replay(x):
            if window[0] == len(outputs):
                outputs.append(forward(x))
            return outputs[window[0]]
        return replay

    def run(stop_at: nn.Module | None = None, hessian: _Hessian | None = None) -> list[torch.Tensor]:
        def reach(_linear, args):
            hessian.add(args[0])
            raise _InputReached

        hook = stop_at.register_forward_pre_hook(reach) if stop_at is not None else None
        outputs = []
        try:
            for i, (x, args) in enumerate(zip(hidden, arguments)):
                window[0] = i
                _clear_cache(layer)
                try:
                    outputs.append(layer(x, *args))
                except _InputReached:
                    pass
        finally:
            if hook is not None:
                hook.remove()
        return outputs

    quantized = []
    try:
        for linears in groups:
            hessian = _Hessian(linears[0].in_features)
            run(linears[0], hessian)
            _quantize(linears, hessian.value(), group_size, int4_weight)
            for linear in linears:
                linear.forward = replayed(linear.forward)
                quantized.append(linear)
        return run()
    finally:
        for linear in quantized:
            del linear.forward  # the class's forward again


@torch.no_grad()
def apply_gptq(module, windows: list[torch.Tensor], group_size: int,
               int4_weight: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]) -> None:
    """Quantizes every float linear of `module` (decoder layers, then the output layer) in place.
    int4_weight(weight on the grid, scales, block size) -> the scheme's torchao weight tensor."""
    if not windows:
        raise ValueError("gptq needs calibration windows")
    if not _float_linears(module):
        return
    inputs = _first_layer_inputs(module, windows)
    hidden, arguments = [args[0] for args in inputs], [args[1:] for args in inputs]
    for layer in module.model.layers:
        hidden = quantize_layer(layer, hidden, arguments, group_size, int4_weight)
    head = _float_linears(module.lm_head)
    if head:  # its Hessian from the final norm's outputs: the vocabulary-wide logits are never needed
        hessian = _Hessian(module.lm_head.in_features)
        for x in hidden:
            hessian.add(module.model.norm(x))
        _quantize(head, hessian.value(), group_size, int4_weight)
    module.reset_cache()
