"""Rotary position embeddings as Hugging Face's Llama computes them: frequencies from transformers' own rope code,
cos/sin per position, and rotate_half (also as a constant matrix, for a fused q/k/v)."""
from __future__ import annotations

import torch

from models.module_options import LlamaShape


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention scaling), from transformers' own rope code so every
    rope_type it knows (llama3 scaling included) comes out exactly as Hugging Face computes it."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] in fp32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rope_tables(config, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] (rope_at of every position)."""
    inv_freq, scaling = rope_frequencies(config)
    return rope_at(torch.arange(max_seq_len), inv_freq, scaling)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R with x @ R.T == rotate_half(x): a signed permutation, so the product is exact."""
    return rotate_half(torch.eye(head_dim)).T.contiguous()


def rope_head_mask(shape: LlamaShape) -> torch.Tensor:
    """[all heads, 1]: 1 on the q and k heads of the fused q/k/v, 0 on the v heads."""
    mask = torch.zeros(shape.n_heads + 2 * shape.n_kv_heads, 1)
    mask[: shape.n_heads + shape.n_kv_heads] = 1.0
    return mask
