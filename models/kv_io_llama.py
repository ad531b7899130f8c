"""LlamaForExport with its KV caches as inputs and outputs in the layout of a runner that keeps the caches itself and
passes each call only the rows written so far (an "AR-N" program: N tokens per call, N fixed per program).

forward(tokens[1, T] int32, atten_mask[1, 1, T, C] float, input_pos[1, T] int32, *k_caches, *v_caches)
    -> (logits[1, T, vocab], *k_new, *v_new)

C is the context. Each k cache is [1, kv heads, head_dim, C - T] (keys stored transposed, so a call's new keys are
appended along the last dimension), each v cache [1, kv heads, C - T, head_dim]; k_new [1, kv heads, head_dim, T]
and v_new [1, kv heads, T, head_dim] are this call's rows only, which the caller writes into its caches. The mask is
additive over the C - T cache columns followed by the T new ones (0 where a query may attend). input_pos holds each
token's position, for the rope tables. The program holds no state, so one weight set serves a prefill program
(T = N) and a decode program (T = 1). GQA heads are expanded with 4-D slices, expand and cat, a form compilers
that reject 5-D views take."""
from __future__ import annotations

import torch
from torch import nn

from models.llama import LlamaForExport
from models.rope import rotate_half

PADDING_MASK_VALUE = -255.0  # what a masked column adds before the softmax


def _grouped(cache: torch.Tensor, repeat: int, dim_heads: int = 1) -> torch.Tensor:
    if repeat == 1:
        return cache
    return torch.cat([cache[:, h:h + 1].expand(-1, repeat, -1, -1) for h in range(cache.shape[dim_heads])], dim=1)


class DecoderLayer(nn.Module):
    """A decoder layer's own modules, called with its caches: (hidden state, k_new, v_new). Named as the
    module's layer class, so what finds a layer's output by its class finds it here."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm

    def forward(self, x, cos, sin, k_cache, v_cache, mask):
        attended, k, v = _attention(self.self_attn, self.input_layernorm(x), cos, sin, k_cache, v_cache, mask)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


def _attention(attn, x, cos, sin, k_cache, v_cache, mask):
    """One layer's attention: (output, this call's keys [1, kv heads, head_dim, T], values [1, kv heads, T, head_dim])."""
    bsz, seq_len, _ = x.shape
    q = attn.q_proj(x).view(bsz, seq_len, attn.n_heads, attn.head_dim)
    k = attn.k_proj(x).view(bsz, seq_len, attn.n_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(bsz, seq_len, attn.n_kv_heads, attn.head_dim)
    q = (q * cos + rotate_half(q) * sin).transpose(1, 2)
    k = (k * cos + rotate_half(k) * sin).permute(0, 2, 3, 1)
    v = v.transpose(1, 2)
    repeat = attn.n_heads // attn.n_kv_heads
    keys = _grouped(torch.cat([k_cache, k], dim=-1), repeat)
    values = _grouped(torch.cat([v_cache, v], dim=2), repeat)
    scores = torch.matmul(q, keys) * (attn.head_dim ** -0.5) + mask
    out = torch.matmul(torch.softmax(scores, dim=-1), values).transpose(1, 2)
    return attn.o_proj(out.reshape(bsz, seq_len, attn.n_heads * attn.head_dim)), k, v


class KvIoLlama(nn.Module):
    def __init__(self, llama: LlamaForExport):
        super().__init__()
        if llama.options.fuse_qkv:
            raise ValueError("the KV-I/O form takes separate q/k/v projections; build the module with fuse_qkv=False")
        # the same submodule names as LlamaForExport, so what finds a layer or the output layer by name finds it here
        self.model = nn.Module()
        self.model.embed_tokens, self.model.norm = llama.model.embed_tokens, llama.model.norm
        self.model.layers = nn.ModuleList(DecoderLayer(layer) for layer in llama.model.layers)
        self.lm_head = llama.lm_head
        self.shape, self.options = llama.shape, llama.options
        self.register_buffer("rope_cos", llama.rope_cos, persistent=False)
        self.register_buffer("rope_sin", llama.rope_sin, persistent=False)
        self.context = llama.options.max_seq_len

    @property
    def n_layers(self) -> int:
        return self.shape.n_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.options.dtype

    def cache_shapes(self, tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(k cache shape, v cache shape) of a `tokens`-token program."""
        shape = self.shape
        rows = self.context - tokens
        return (1, shape.n_kv_heads, shape.head_dim, rows), (1, shape.n_kv_heads, rows, shape.head_dim)

    def example_inputs(self, tokens: int) -> tuple:
        """A `tokens`-token call at position 0 with empty caches: what torch.export traces."""
        k_shape, v_shape = self.cache_shapes(tokens)
        mask = torch.full((1, 1, tokens, self.context), PADDING_MASK_VALUE, dtype=self.dtype)
        return (torch.zeros((1, tokens), dtype=torch.int32), mask, torch.zeros((1, tokens), dtype=torch.int32),
                *[torch.zeros(k_shape, dtype=self.dtype) for _ in range(self.n_layers)],
                *[torch.zeros(v_shape, dtype=self.dtype) for _ in range(self.n_layers)])

    def forward(self, tokens, atten_mask, input_pos, *caches):
        shape = self.shape
        n_layers, seq_len = shape.n_layers, tokens.shape[1]
        positions = input_pos[0]
        cos = self.rope_cos.index_select(0, positions).view(1, seq_len, 1, shape.head_dim)
        sin = self.rope_sin.index_select(0, positions).view(1, seq_len, 1, shape.head_dim)
        x = self.model.embed_tokens(tokens)
        k_new, v_new = [], []
        for layer, k_cache, v_cache in zip(self.model.layers, caches[:n_layers], caches[n_layers:]):
            x, k, v = layer(x, cos, sin, k_cache, v_cache, atten_mask)
            k_new.append(k)
            v_new.append(v)
        return (self.lm_head(self.model.norm(x)), *k_new, *v_new)
