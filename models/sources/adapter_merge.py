"""A checkpoint's weights with a LoRA adapter merged in: each linear the adapter targets reads as
W + scaling * B @ A, computed in fp32 when the tensor is read and cast to the dtype asked for (or the one it is
stored in), before the module is built and quantized. Nothing merged is kept: weights read lazily from safetensors
stay lazy, one tensor at a time, and only the adapter's small factors are held beside them."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

import torch

from models.errors import UserFacingError
from models.sources.adapter import LoraAdapter


class MergedWeights(Mapping):
    """The base weights (a SafetensorsWeights or a dict) with the adapter's entries replaced by their merged
    tensors. Every read is a fresh tensor, as SafetensorsWeights gives them, so nothing aliases the base."""

    def __init__(self, base: Mapping[str, torch.Tensor], adapter: LoraAdapter):
        self.base, self.adapter = base, adapter

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = getattr(self.base, "shape", None)
        return tuple(shape(name)) if shape is not None else tuple(self.base[name].shape)

    def stored_dtype(self, name: str) -> torch.dtype:
        stored = getattr(self.base, "stored_dtype", None)
        return stored(name) if stored is not None else self.base[name].dtype

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.stored_dtype(name)
        factors = self.adapter.factors.get(name)
        if factors is None:
            return _read_copy(self.base, name, dtype)
        merged = _read_copy(self.base, name, torch.float32)
        merged += factors.delta()
        return merged.to(dtype)


def merge_adapter(weights: Mapping[str, torch.Tensor], adapter: LoraAdapter, where: str) -> MergedWeights:
    """The weights with the adapter merged, once each targeted tensor is checked to be there in the shape its
    factors make (check_adapter_fits checked the config; this checks the file that came with it)."""
    shape = getattr(weights, "shape", None)
    for name, factors in adapter.factors.items():
        if name not in weights:
            raise UserFacingError(f"the adapter {adapter.id} changes {name.removesuffix('.weight')}, which {where} "
                                  "does not have; give an adapter trained on this model.")
        stored = tuple(shape(name)) if shape is not None else tuple(weights[name].shape)
        if stored != (factors.b.shape[0], factors.a.shape[1]):
            raise UserFacingError(f"the adapter {adapter.id}'s {name.removesuffix('.weight')} is "
                                  f"{[factors.b.shape[0], factors.a.shape[1]]}, {where}'s is {list(stored)}: it was "
                                  "trained on another model; give an adapter trained on this one.")
    return MergedWeights(weights, adapter)


def _read_copy(weights: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    read = getattr(weights, "read", None)  # a lazy checkpoint copies one tensor out of its file
    return read(name, dtype) if read is not None else weights[name].to(dtype, copy=True)
