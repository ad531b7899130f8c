"""attention="sdpa-slice": aten SDPA with the cache written as one slice at input_pos[0] and the causal mask made by
comparison, with no index_put of several positions and no gather of a bool tensor (what Core ML converts)."""
from __future__ import annotations

import torch

from models.attention.aten import AtenAttention
from models.attention.base import form


@form("sdpa-slice")
class SlicedSdpa(AtenAttention):
    def write_cache(self, k, v, start_pos, positions) -> None:
        seq_len = k.shape[2]
        self.k_cache[:, :, start_pos : start_pos + seq_len] = k
        self.v_cache[:, :, start_pos : start_pos + seq_len] = v

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        options = module.options
        start_pos = cls.checked_start(input_pos, seq_len, options, bounded=True)
        return start_pos, torch.arange(options.max_seq_len)[None, :] <= positions[:, None]
