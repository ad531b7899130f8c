"""attention="grouped-slice": the sdpa-slice cache (one slice written at input_pos[0], the causal mask made by
comparison) attended with the attention written out and the query heads grouped per kv head
(base.grouped_attention): no fused SDPA, which Core ML computes wrong on iOS 26, and no copy of the kv heads."""
from __future__ import annotations

import torch

from models.attention.base import form, grouped_attention
from models.attention.sdpa_slice import SlicedSdpa


@form("grouped-slice")
class GroupedSlice(SlicedSdpa):
    def attend(self, q, k, v, start_pos, positions, mask) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        self.write_cache(k, v, start_pos, positions)
        return grouped_attention(q, self.k_cache, self.v_cache, mask).transpose(1, 2)

    def write_cache(self, k, v, start_pos, positions) -> None:
        # a slice_scatter of the whole cache: a slice assignment copies k into the slice through an expand to
        # the slice's shape, which coremltools makes a tile (of one repeat) of the new rows
        seq_len = k.shape[2]
        for value, cache in ((k, self.k_cache), (v, self.v_cache)):
            cache.copy_(cache.slice_scatter(value, dim=2, start=start_pos, end=start_pos + seq_len))

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        start_pos, visible = super().start_and_mask(module, positions, input_pos, seq_len)
        # additive, made once per call for every layer
        return start_pos, torch.where(visible, 0.0, float("-inf")).to(module.options.dtype)
