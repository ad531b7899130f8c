"""Linear layers whose weights stay in the checkpoint's half precision while the module computes in fp32.

Every bf16 or fp16 value is exactly an fp32 value, so upcasting a weight as its layer runs gives the results of
the module built in fp32, while holding half the bytes. The upcast goes into one fp32 scratch tensor per weight
shape, reused by every layer of that shape: a fresh fp32 tensor per call would page-fault its way through the
whole model's fp32 size on every step."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class _UpcastIntoScratch(nn.Module):
    def __init__(self, dtype: torch.dtype, scratch: dict):
        super().__init__()
        self.dtype, self.scratch = dtype, scratch

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        # Safe to share: eager layers run one after another, and each is done with its weight before the next
        # layer of the same shape upcasts into it.
        buffer = self.scratch.get(stored.shape)
        if buffer is None:
            buffer = self.scratch[stored.shape] = torch.empty(stored.shape, dtype=self.dtype)
        return buffer.copy_(stored)


def compute_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Makes `module`'s linear layers whose weights are stored in another dtype compute in `dtype`."""
    scratch: dict = {}
    for owner in module.modules():
        if isinstance(owner, nn.Linear) and owner.weight.dtype != dtype:
            parametrize.register_parametrization(owner, "weight", _UpcastIntoScratch(dtype, scratch), unsafe=True)
