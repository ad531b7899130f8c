"""attention="custom" with ExportOptions.kv_window: the cache is a ring. The first ATTENTION_SINK_TOKENS tokens stay
for good, and every token attends to them and to its kv_window most recent ones, at any position, so a chat goes
on past the cache. Written and read by ExecuTorch's custom ops through row indices and an additive mask; rope
angles are computed per call from the frequencies (a table would end at the cache's length)."""
from __future__ import annotations

import torch

from models.attention.base import form
from models.attention.executorch_ops import ExecutorchOpsAttention
from models.module_options import ATTENTION_SINK_TOKENS, ExportOptions, LlamaShape
from models.rope import rope_at, rope_frequencies


@form("custom", ring=True)
class RingCache(ExecutorchOpsAttention):
    def __init__(self, shape: LlamaShape, options: ExportOptions):
        super().__init__(shape, options)
        self.window = options.kv_window
        self.call_tokens = options.call_tokens

    def attend(self, q, k, v, start_pos, positions, mask) -> torch.Tensor:
        """An eager call of more tokens than the program takes (a calibration window) goes through in pieces of
        call_tokens, so that no write evicts a row the same call still reads; an exported call has at most
        call_tokens tokens."""
        seq_len = q.shape[1]
        if isinstance(seq_len, int) and seq_len > self.call_tokens:
            pieces = []
            for first in range(0, seq_len, self.call_tokens):
                part = slice(first, first + self.call_tokens)
                part_positions = positions[part]
                part_mask = ring_mask(part_positions, self.window, self.k_cache.shape[1])
                pieces.append(self.attend(q[:, part], k[:, part], v[:, part], start_pos + first,
                                          part_positions, part_mask))
            return torch.cat(pieces, dim=1)
        self.write_cache(k, v, start_pos, ring_rows(positions, self.k_cache.shape[1])[None, :])
        return self.attend_cache(q, start_pos, mask)

    @classmethod
    def start_and_mask(cls, module, positions, input_pos, seq_len):
        options = module.options
        start_pos = cls.checked_start(input_pos, seq_len, options, bounded=False)
        return start_pos, ring_mask(positions, options.kv_window, options.cache_rows)

    @classmethod
    def add_rope_buffers(cls, module, config, options) -> None:
        inv_freq, module.rope_scaling = rope_frequencies(config)
        module.register_buffer("rope_inv_freq", inv_freq, persistent=False)

    @classmethod
    def fill_rope_buffers(cls, module, config, options) -> None:
        module.rope_inv_freq.copy_(rope_frequencies(config)[0])

    @classmethod
    def rope(cls, module, positions, dtype):
        head_dim = module.shape.head_dim
        cos, sin = rope_at(positions, module.rope_inv_freq, module.rope_scaling, head_dim)
        return cos.to(dtype).view(1, -1, 1, head_dim), sin.to(dtype).view(1, -1, 1, head_dim)


def ring_rows(positions: torch.Tensor, cache_rows: int) -> torch.Tensor:
    """The cache row of each position: the sinks' own rows, then around the ring."""
    sinks, ring = ATTENTION_SINK_TOKENS, cache_rows - ATTENTION_SINK_TOKENS
    return torch.where(positions < sinks, positions, sinks + (positions - sinks) % ring)


def ring_mask(positions: torch.Tensor, window: int, cache_rows: int) -> torch.Tensor:
    """Additive mask [T, cache rows] for a call at consecutive `positions` (the program is fed every position
    from 0 in order): each query sees the sink rows at or before it and the rows holding its `window` most
    recent positions. Which position a row holds follows from the last position written, so the mask needs no
    state of its own."""
    sinks, ring = ATTENTION_SINK_TOKENS, cache_rows - ATTENTION_SINK_TOKENS
    rows = torch.arange(cache_rows, dtype=torch.long)
    last = positions[-1:]
    # a ring row holds the latest position up to `last` that maps to it; one below the sinks was not written yet
    held = torch.where(rows < sinks, rows, last - (last - rows) % ring)
    queries = positions[:, None]
    visible = (held <= queries) & ((rows < sinks) | ((held >= sinks) & (held > queries - window)))
    return torch.where(visible, 0.0, float("-inf"))
