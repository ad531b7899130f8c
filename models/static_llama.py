"""The static-shape form of LlamaForExport, for compilers that take fixed shapes only (the Apple Neural Engine).

forward(tokens[1, T], input_pos[1], mask[1, 1, T, C + T], k_caches, v_caches) -> (logits[1, T, vocab],
k_new, v_new): T is fixed per program (a prefill chunk, or 1 for decode), each cache is [1, kv heads, C, head_dim]
with C the context, and the program holds no state: the caller keeps the caches, writes each call's new K/V rows
(k_new, v_new: [1, kv heads, T, head_dim] per layer) at input_pos, and builds the additive mask (0 where a query
may attend, -inf elsewhere) over the C cache rows followed by the T new ones. Nothing of its shape depends on a
value, so a call is the same graph at every position. The weights and rope tables are the wrapped LlamaForExport's
(quantized or not), so both are the same model; linears wider than `max_outputs` become several narrower ones
(row slices of the same weight, exact), the widths a Neural Engine compiles best.
"""
from __future__ import annotations

import torch
from torch import nn

from models.attention.base import AttentionForm, grouped_attention
from models.llama import LlamaForExport

class SplitLinear(nn.Module):
    """A linear computed as row blocks of its weight, joined on the output: the same numbers, narrower ops."""

    def __init__(self, linear: nn.Linear, max_outputs: int):
        super().__init__()
        rows = linear.weight.shape[0]
        self.parts = nn.ModuleList()
        for start in range(0, rows, max_outputs):
            stop = min(start + max_outputs, rows)
            with torch.device("meta"):
                part = nn.Linear(linear.weight.shape[1], stop - start, bias=linear.bias is not None)
            part.weight = nn.Parameter(_own_rows(linear.weight.data, start, stop), requires_grad=False)
            if linear.bias is not None:
                part.bias = nn.Parameter(_own_rows(linear.bias.data, start, stop), requires_grad=False)
            self.parts.append(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _own_rows(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows start:stop in storage of their own. A slice shares its parent's storage at an offset, and a program
    lowered from such constants computes wrong logits on the ExecuTorch runtime."""
    return tensor[start:stop].clone()


def split_wide_linears(module: nn.Module, max_outputs: int) -> int:
    """Replaces, in place, every nn.Linear with more than `max_outputs` outputs; returns how many were split."""
    wide = [(name, child) for name, child in module.named_modules()
            if isinstance(child, nn.Linear) and child.weight.shape[0] > max_outputs]
    for name, linear in wide:
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attr, SplitLinear(linear, max_outputs))
    return len(wide)


def _static_attention(attn: AttentionForm, x, cos, sin, k_cache, v_cache, mask):
    """One layer's attention over the given cache and this call's own keys: (output, k_new, v_new)."""
    bsz, seq_len, _ = x.shape
    q, k, v = (t.transpose(1, 2) for t in attn.project(x, (cos, sin, None)))
    keys, values = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
    out = grouped_attention(q, keys, values, mask).transpose(1, 2)
    return attn.o_proj(out.reshape(bsz, seq_len, attn.n_heads * attn.head_dim)), k, v


class StaticLlama(nn.Module):
    def __init__(self, llama: LlamaForExport, max_outputs: int | None = None):
        super().__init__()
        if llama.options.fuse_qkv:
            raise ValueError("the static form takes separate q/k/v projections; build the module with fuse_qkv=False")
        self.llama = llama
        self.context = llama.options.max_seq_len
        if max_outputs:
            split_wide_linears(llama, max_outputs)
        # Rope rows past the context, for the padding of a last chunk (their outputs are unused): the positions are
        # then looked up as they are, with no clamp, which Core ML would compute in float.
        for name in ("rope_cos", "rope_sin"):
            table = getattr(llama, name)
            self.register_buffer(name, torch.cat([table, torch.zeros_like(table)]), persistent=False)

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        shape = self.llama.shape
        return (1, shape.n_kv_heads, self.context, shape.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.llama.options.dtype

    def example_inputs(self, tokens: int) -> tuple:
        """Inputs of a `tokens`-token call at position 0 with empty caches: what torch.export traces."""
        n_layers = self.llama.shape.n_layers
        caches = [torch.zeros(self.cache_shape, dtype=self.dtype) for _ in range(2 * n_layers)]
        mask = torch.zeros((1, 1, tokens, self.context + tokens), dtype=self.dtype)
        return (torch.zeros((1, tokens), dtype=torch.long), torch.zeros((1,), dtype=torch.long), mask,
                caches[:n_layers], caches[n_layers:])

    def forward(self, tokens, input_pos, mask, k_caches: list, v_caches: list):
        llama = self.llama
        seq_len = tokens.shape[1]
        positions = input_pos + torch.arange(seq_len, dtype=torch.long)
        cos = self.rope_cos.index_select(0, positions).view(1, seq_len, 1, llama.shape.head_dim)
        sin = self.rope_sin.index_select(0, positions).view(1, seq_len, 1, llama.shape.head_dim)
        x = llama.model.embed_tokens(tokens)
        k_new, v_new = [], []
        for layer, k_cache, v_cache in zip(llama.model.layers, k_caches, v_caches):
            attended, k, v = _static_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, k_cache, v_cache,
                                               mask)
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            k_new.append(k)
            v_new.append(v)
        return llama.lm_head(llama.model.norm(x)), k_new, v_new

