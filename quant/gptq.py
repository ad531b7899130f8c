"""GPTQ (Frantar et al., 2022, arXiv:2210.17323, Algorithm 1) for int4 group-wise linears, on the CPU.

Each linear's Hessian (2 XᵀX of its inputs on the calibration text) is collected by torchao's own GPTQ
observer (torchao.prototype.gptq.GPTQObserverTensor). torchao 0.18's quantizing loop, though, asserts a CUDA
device and writes mslk's asymmetric Int4Tensor, which ExecuTorch's backends do not take; the loop below
quantizes to the symmetric int4 groups every other algorithm makes, ending in the same torchao tensor
(IntxUnpackedToInt8Tensor with the group scales given), so the program and its bytes per token are those of
minmax.

The decoder layers are quantized in order, each observing the inputs the already quantized layers before it
produce (GPTQ's sequential form), then the output layer. Columns go in order of decreasing Hessian diagonal
("act order"); each group's scale is fixed beforehand from the float weights, by the clipping of the group's
maximum that gives the least squared error (GPTQ's reference quantizer's search), so reordering the columns
never mixes groups. Once the integers are chosen, each row's group scales are solved again for them against
the same Hessian (refit_scales): the loop chose the integers for scales fitted to the weights alone.
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
    ||X Wᵀ - X Qᵀ||² for the inputs X whose `hessian` is given, column by column."""
    dead = torch.diag(hessian) == 0  # an input that is always zero: any value of its column will do
    hessian = _damped(hessian, damping)
    columns = weight.shape[1]
    scales = group_scales(weight.to(torch.float32).masked_fill(dead, 0), group_size)
    order = torch.argsort(torch.diag(hessian), descending=True)
    group_of = (order // group_size).tolist()
    weight = weight[:, order].to(torch.float32).masked_fill_(dead[order], 0)  # a copy: the caller's stays
    hessian = hessian[order][:, order]
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    values = torch.empty_like(weight, dtype=torch.int8)
    for start in range(0, columns, BLOCK):
        end = min(start + BLOCK, columns)
        block = weight[:, start:end]
        errors = torch.empty_like(block)
        block_inverse = inverse[start:end, start:end]
        for j in range(end - start):
            column, scale = block[:, j], scales[:, group_of[start + j]]
            q = (column / scale).round().clamp(QMIN, QMAX)
            values[:, start + j] = q.to(torch.int8)
            error = (column - q * scale) / block_inverse[j, j]
            block[:, j:].sub_(error[:, None] * block_inverse[j, j:][None, :])
            errors[:, j] = error
        weight[:, end:].sub_(errors @ inverse[start:end, end:])
    return values[:, torch.argsort(order)].contiguous(), scales


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
    for g in range(groups):  # every row's A[g, :] at once: (q_g H_g,:) ⊙ q, summed by group
        columns_g = slice(g * group_size, (g + 1) * group_size)
        a[:, g] = ((q[:, columns_g] @ hessian[columns_g]) * q).view(rows, groups, group_size).sum(-1)
    b = (q * (weight @ hessian)).view(rows, groups, group_size).sum(-1)
    # A group whose integers are all zero leaves its row of A empty: a small pull to the given scale.
    ridge = 1e-6 * a.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True).clamp(min=1e-12)
    solved = torch.linalg.solve(a + torch.diag_embed(ridge.expand(rows, groups)),
                                (b + ridge * scales).unsqueeze(-1)).squeeze(-1)
    refitted = solved.to(torch.bfloat16).to(torch.float32)
    better = (refitted > 0).all(-1) & (_row_errors(weight, hessian, values, refitted, group_size)
                                       < _row_errors(weight, hessian, values, scales, group_size))
    return torch.where(better[:, None], refitted, scales)


class _FirstLayerReached(Exception):
    pass


@torch.no_grad()
def _first_layer_inputs(module, windows: list[torch.Tensor]) -> list[tuple]:
    """The arguments decoder layer 0 is called with, one tuple per calibration window."""
    captured = []

    def stop(_layer, args):
        captured.append(args)
        raise _FirstLayerReached

    hook = module.model.layers[0].register_forward_pre_hook(stop)
    try:
        for tokens in windows:
            try:
                module(tokens, torch.tensor([0]))
            except _FirstLayerReached:
                pass
    finally:
        hook.remove()
    return captured


def _float_linears(unit: nn.Module) -> list[nn.Linear]:
    """The unit's linears still in float (those of a unit kept at 8 bits are quantized already)."""
    return [m for m in unit.modules() if isinstance(m, nn.Linear) and type(m.weight.data) is torch.Tensor]


@torch.no_grad()
def _observe(linears: list[nn.Linear], run: Callable[[], None]) -> list[torch.Tensor]:
    """Each linear's Hessian over what `run` feeds it, from torchao's GPTQ observer."""
    from torchao.prototype.gptq.observer import GPTQObserverTensor

    originals = [linear.weight for linear in linears]
    for linear in linears:
        linear.weight = nn.Parameter(GPTQObserverTensor.from_hp(linear.weight.data.contiguous()), requires_grad=False)
    try:
        run()
        return [linear.weight.data.hessian for linear in linears]
    finally:
        for linear, original in zip(linears, originals):
            linear.weight = original


@torch.no_grad()
def _quantize(linears: list[nn.Linear], hessians: list[torch.Tensor], group_size: int,
              int4_weight: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]) -> None:
    for linear, hessian in zip(linears, hessians):
        values, scales = gptq_weight(linear.weight.data, hessian, group_size)
        scales = refit_scales(linear.weight.data, hessian, values, scales, group_size)
        weight = values.to(torch.float32).view(values.shape[0], -1, group_size) * scales[..., None]
        linear.weight = nn.Parameter(int4_weight(weight.view(values.shape), scales, (1, group_size)),
                                     requires_grad=False)


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
    hidden = [args[0] for args in inputs]

    def run_layer(layer):
        outputs = []
        for x, args in zip(hidden, inputs):
            layer.self_attn.k_cache.zero_()
            layer.self_attn.v_cache.zero_()
            outputs.append(layer(x, *args[1:]))
        return outputs

    for layer in module.model.layers:
        linears = _float_linears(layer)
        if linears:
            _quantize(linears, _observe(linears, lambda: run_layer(layer)), group_size, int4_weight)
        hidden = run_layer(layer)
    def run_head():
        for x in hidden:  # one window's vocabulary-wide logits at a time
            module.lm_head(module.model.norm(x))

    head = _float_linears(module.lm_head)
    if head:
        _quantize(head, _observe(head, run_head), group_size, int4_weight)
    module.reset_cache()
