"""A module whose matrices stay in the checkpoint's half precision while it computes in fp32.

Every bf16 or fp16 value is exactly an fp32 value, so upcasting a weight as it is used gives the results of the
module built in fp32, while holding half the bytes: only the matrix in use exists in fp32, for that one call."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize


class _Upcast(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(self.dtype)


def is_matrix(owner: nn.Module, attr: str) -> bool:
    """The weights kept in their stored dtype: linear layers' and the embedding table's."""
    return attr == "weight" and isinstance(owner, (nn.Linear, nn.Embedding))


def compute_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Makes `module`'s matrices that are stored in another dtype compute in `dtype`. A linear's weight is
    upcast when the layer runs; an embedding looks its rows up in the stored table and upcasts only those."""
    for owner in module.modules():
        if isinstance(owner, nn.Linear) and owner.weight.dtype != dtype:
            parametrize.register_parametrization(owner, "weight", _Upcast(dtype), unsafe=True)
        elif isinstance(owner, nn.Embedding) and owner.weight.dtype != dtype:
            owner.register_forward_hook(lambda _owner, _args, rows: rows.to(dtype))
