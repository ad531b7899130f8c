"""attention="sdpa-onehot": aten SDPA with the cache updated by a one-hot matmul and a blend, and the causal mask
made once per call: no int64 index_put in the layers, so a delegate that takes float ops only (QNN's HTP) takes
them whole."""
from __future__ import annotations

import torch

from models.attention.aten import AtenAttention
from models.attention.base import form


@form("sdpa-onehot")
class OneHotSdpa(AtenAttention):
    def write_cache(self, k, v, start_pos, positions) -> None:
        # positions holds one-hot rows [T, max_seq_len]: the update is a matmul and a blend, all float ops
        keep = 1.0 - positions.sum(0)[:, None]
        self.k_cache.copy_(self.k_cache * keep + torch.matmul(positions.transpose(0, 1), k))
        self.v_cache.copy_(self.v_cache * keep + torch.matmul(positions.transpose(0, 1), v))

    def grouped(self, cache: torch.Tensor) -> torch.Tensor:
        if self.n_kv_heads == self.n_heads:
            return cache
        # 4-D slices + expand + cat: repeat_interleave goes through a 5-D view
        repeat = self.n_heads // self.n_kv_heads
        return torch.cat([cache[:, h : h + 1].expand(-1, repeat, -1, -1) for h in range(self.n_kv_heads)], dim=1)

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        return None, torch.arange(module.options.max_seq_len)[None, :] <= positions[:, None]

    @classmethod
    def layer_positions(cls, module, positions, dtype):
        # made here, so the integer ops stay outside the layers the backend takes whole
        return (torch.arange(module.options.max_seq_len)[None, :] == positions[:, None]).to(dtype)
