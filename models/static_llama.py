"""The static-shape form of LlamaForExport, for compilers that take fixed shapes only (the Apple Neural Engine), in the
contract of ExecuTorch's own static Llama export (examples/apple/coreml/llama/export_static_llm_coreml.py, whose
programs its StaticAttentionIOManager drives; docs/coreml.md):

forward(tokens[1, T] int32, mask[1, T, C + T], freqs_cos[T, D/2], freqs_sin[T, D/2], k_caches, v_caches,
last_valid_token_pos[1] int64) -> (logits[1, 1, vocab], k_new, v_new): T is fixed per program (a prefill chunk, or 1
for decode), each cache is [1, kv heads, C, D] with C = context - 1, and the program holds no state: the caller keeps
the caches, writes each call's new K/V rows (k_new, v_new: [1, kv heads, T, D] per layer) at their positions, passes
the rope rows of the call's positions (the first half of each row of Hugging Face's cos/sin tables, which repeat
it) and builds the additive mask (0 where a query may attend, -inf elsewhere) over the C cache rows followed by the
T new ones; the logits are those of the token at last_valid_token_pos. Nothing of its shape depends on a value, so a
call is the same graph at every position. The weights are the wrapped LlamaForExport's (quantized or not), so both
are the same model; linears wider than `max_outputs` become several narrower ones (row slices of the same weight,
exact), the widths a Neural Engine compiles best.
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


def half_rope_table(table: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """[rows, D/2] of a Hugging Face cos or sin table [rows, D]: each row's first rotary_dim / 2 values (the table
    repeats them), then its padding (cos 1, sin 0) past the rotated dims."""
    half, head_dim = rotary_dim // 2, table.shape[-1]
    return torch.cat([table[:, :half], table[:, rotary_dim:rotary_dim + head_dim // 2 - half]], dim=-1)


def full_rope_rows(rows: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """[T, D] of half_rope_table's rows [T, D/2]: the rotated values twice, then the padding twice."""
    half = rotary_dim // 2
    rotated, rest = rows[:, :half], rows[:, half:]
    return torch.cat([rotated, rotated] + ([rest, rest] if rest.shape[-1] else []), dim=-1)


# Where each input and output sits in the flat lists of a method's call: ExecuTorch's static export's order.
TOKENS_INPUT, MASK_INPUT, FREQS_COS_INPUT, FREQS_SIN_INPUT, FIRST_CACHE_INPUT = 0, 1, 2, 3, 4
LOGITS_OUTPUT, FIRST_CACHE_OUTPUT = 0, 1


class StaticLlama(nn.Module):
    def __init__(self, llama: LlamaForExport, max_outputs: int | None = None):
        super().__init__()
        if llama.options.fuse_qkv:
            raise ValueError("the static form takes separate q/k/v projections; build the module with fuse_qkv=False")
        self.llama = llama
        self.context = llama.options.max_seq_len
        if max_outputs:
            split_wide_linears(llama, max_outputs)

    @property
    def cache_len(self) -> int:
        """Cache rows: every position but the last, whose K/V no later token reads."""
        return self.context - 1

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        shape = self.llama.shape
        return (1, shape.n_kv_heads, self.cache_len, shape.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.llama.options.dtype

    @property
    def rotary_dim(self) -> int:
        return self.llama.shape.rotary_dim or self.llama.shape.head_dim

    def rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """freqs_cos, freqs_sin [context, D/2]: the rows a caller passes, one per position."""
        return (half_rope_table(self.llama.rope_cos, self.rotary_dim),
                half_rope_table(self.llama.rope_sin, self.rotary_dim))

    def example_inputs(self, tokens: int) -> tuple:
        """Inputs of a `tokens`-token call at position 0 with empty caches: what torch.export traces."""
        n_layers = self.llama.shape.n_layers
        caches = [torch.zeros(self.cache_shape, dtype=self.dtype) for _ in range(2 * n_layers)]
        mask = torch.zeros((1, tokens, self.cache_len + tokens), dtype=self.dtype)
        cos, sin = self.rope_tables()
        return (torch.zeros((1, tokens), dtype=torch.int32), mask, cos[:tokens].clone(), sin[:tokens].clone(),
                caches[:n_layers], caches[n_layers:], torch.tensor([tokens - 1], dtype=torch.long))

    def forward(self, tokens, mask, freqs_cos, freqs_sin, k_caches: list, v_caches: list, last_valid_token_pos):
        llama = self.llama
        seq_len, head_dim = tokens.shape[1], llama.shape.head_dim
        cos = full_rope_rows(freqs_cos, self.rotary_dim).view(1, seq_len, 1, head_dim)
        sin = full_rope_rows(freqs_sin, self.rotary_dim).view(1, seq_len, 1, head_dim)
        x = llama.model.embed_tokens(tokens)
        k_new, v_new = [], []
        for layer, k_cache, v_cache in zip(llama.model.layers, k_caches, v_caches):
            attended, k, v = _static_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, k_cache, v_cache,
                                               mask)
            x = x + attended
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            k_new.append(k)
            v_new.append(v)
        if last_valid_token_pos is not None:  # None: every position's logits, for an eager caller only
            x = x[:, last_valid_token_pos, :]
        return llama.lm_head(llama.model.norm(x)), k_new, v_new
