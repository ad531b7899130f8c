"""Drives a program of two KV-I/O methods (models/kv_io_llama.py) as a runner that keeps the caches does: the prompt
in calls of the prefill method's N tokens (the last one padded), then one token per call of the decode method. The
caller keeps every layer's cache; each call gets the rows written so far at the front of its cache inputs and a
mask that opens them ("smart mask"), and its new rows are appended. `call(method, inputs) -> outputs` runs a method:
the converted modules in PyTorch, or a loaded .pte."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

PADDING_MASK_VALUE = -255.0


@dataclass
class KvIoSession:
    call: Callable[[str, list], list]
    prefill_method: str
    decode_method: str
    prefill_len: int
    n_layers: int
    kv_heads: int
    head_dim: int
    context: int
    dtype: torch.dtype = torch.float32
    position: int = 0
    keys: list = field(default_factory=list)  # per layer [1, kv heads, head_dim, position]
    values: list = field(default_factory=list)  # per layer [1, kv heads, position, head_dim]

    def reset(self) -> None:
        self.position, self.keys, self.values = 0, [], []

    def _run(self, method: str, width: int, tokens: list[int]) -> torch.Tensor:
        """One call of `method` (width tokens per call) on `tokens` (at most width); the logits of those tokens."""
        count, start, rows = len(tokens), self.position, self.context - width
        if start + count > self.context or start > rows:
            raise ValueError(f"the context of {self.context} tokens is full")
        ids = torch.tensor([tokens + [0] * (width - count)], dtype=torch.int32)
        positions = torch.clamp(torch.arange(start, start + width, dtype=torch.int32), max=self.context - 1)[None]
        mask = torch.full((1, 1, width, self.context), PADDING_MASK_VALUE, dtype=self.dtype)
        mask[..., :start] = 0
        mask[0, 0, :, rows:] = torch.where(torch.tril(torch.ones(width, width, dtype=torch.bool)), 0.0, PADDING_MASK_VALUE)
        keys = [torch.zeros((1, self.kv_heads, self.head_dim, rows), dtype=self.dtype) for _ in range(self.n_layers)]
        values = [torch.zeros((1, self.kv_heads, rows, self.head_dim), dtype=self.dtype) for _ in range(self.n_layers)]
        for cache, written in zip(keys, self.keys):
            cache[..., :start] = written
        for cache, written in zip(values, self.values):
            cache[:, :, :start] = written
        outputs = self.call(method, [ids, mask, positions, *keys, *values])
        logits, k_new, v_new = outputs[0], outputs[1:1 + self.n_layers], outputs[1 + self.n_layers:]
        if not self.keys:
            self.keys = [k.new_zeros((*k.shape[:3], 0)) for k in k_new]
            self.values = [v.new_zeros((*v.shape[:2], 0, v.shape[3])) for v in v_new]
        self.keys = [torch.cat([old, k[..., :count]], dim=-1) for old, k in zip(self.keys, k_new)]
        self.values = [torch.cat([old, v[:, :, :count]], dim=2) for old, v in zip(self.values, v_new)]
        self.position += count
        return logits[0, :count]

    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """Logits of every prompt token, in calls of prefill_len; past the last position a whole call fits at
        (the prefill method's cache holds context - prefill_len rows), one token per decode call."""
        chunks, done = [], 0
        while done < len(tokens):
            if self.position <= self.context - self.prefill_len:
                chunk = tokens[done:done + self.prefill_len]
                chunks.append(self._run(self.prefill_method, self.prefill_len, chunk))
            else:
                chunk = tokens[done:done + 1]
                chunks.append(self._run(self.decode_method, 1, chunk))
            done += len(chunk)
        return torch.cat(chunks)

    def decode(self, token: int) -> torch.Tensor:
        return self._run(self.decode_method, 1, [token])[0]

    def generate(self, prompt: list[int], max_new_tokens: int, stop: set[int] = frozenset()) -> list[int]:
        """Greedy tokens after the prompt: prefill by N, then decode one by one."""
        self.reset()
        logits = self.prefill(prompt)[-1]
        out = []
        while len(out) < max_new_tokens and self.position < self.context:
            token = int(torch.argmax(logits))
            out.append(token)
            if token in stop or self.position >= self.context:
                break
            logits = self.decode(token)
        return out


class KvIoSimulation(torch.nn.Module):
    """A KV-I/O program's methods run as its runner would, behind the interface of a module that keeps its cache
    (forward(tokens, input_pos) -> logits of every token): a call at position 0 starts over, a call of several
    tokens is prefilled by the prefill method, a call of one token is decoded by the decode method."""

    def __init__(self, methods: dict[str, torch.nn.Module], session: KvIoSession, shape):
        super().__init__()
        self.methods = torch.nn.ModuleDict(methods)
        self.session = session
        self.shape = shape  # the model's LlamaShape, for the program's metadata
        session.call = self._call

    def _call(self, method: str, inputs: list) -> list:
        with torch.no_grad():
            return list(self.methods[method](*inputs))

    def reset_cache(self) -> None:
        self.session.reset()

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        start = int(input_pos.reshape(-1)[0])
        if start == 0:
            self.session.reset()
        elif start != self.session.position:
            raise ValueError(f"a call at position {start} after {self.session.position} tokens; the caches of this "
                             "program only grow from where the last call ended")
        ids = tokens[0].tolist()
        logits = self.session.decode(ids[0])[None] if len(ids) == 1 else self.session.prefill(ids)
        return logits[None]
