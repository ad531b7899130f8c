"""attention="sdpa": the portable form and the eager reference. The cache is written by index_put at the call's
positions; the causal mask is a [max_seq_len, max_seq_len] table on the module, a call taking its rows."""
from __future__ import annotations

import torch

from models.attention.aten import AtenAttention
from models.attention.base import form


@form("sdpa")
class AtenSdpa(AtenAttention):
    def write_cache(self, k, v, start_pos, positions) -> None:
        self.k_cache[:, :, positions] = k
        self.v_cache[:, :, positions] = v

    @classmethod
    def add_module_buffers(cls, module, options) -> None:
        causal = torch.tril(torch.ones(options.max_seq_len, options.max_seq_len, dtype=torch.bool))
        module.register_buffer("causal_mask", causal, persistent=False)

    @classmethod
    def fill_module_buffers(cls, module, options) -> None:
        module.causal_mask.copy_(torch.tril(torch.ones_like(module.causal_mask)))

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        return None, module.causal_mask.index_select(0, positions)
