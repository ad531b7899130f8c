"""The attention the aten forms share: the cache [1, kv heads, max_seq_len, head_dim] in the module's dtype, attended
by aten's scaled_dot_product_attention under a mask, with grouped heads repeated to the query heads. Each form
writes the cache its own way (write_cache)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.attention.base import AttentionForm


class AtenAttention(AttentionForm):
    def attend(self, q, k, v, start_pos, positions, mask) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        self.write_cache(k, v, start_pos, positions)
        keys, values = self.grouped(self.k_cache), self.grouped(self.v_cache)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return out.transpose(1, 2)

    def write_cache(self, k, v, start_pos, positions) -> None:
        """k, v [1, kv heads, T, head_dim] into the caches."""
        raise NotImplementedError

    def grouped(self, cache: torch.Tensor) -> torch.Tensor:
        """The cache with each kv head repeated for the query heads it serves."""
        if self.n_kv_heads == self.n_heads:
            return cache
        return cache.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
