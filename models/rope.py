"""Rotary position embeddings as Hugging Face computes them for the checkpoint's family: cos/sin from transformers'
own rotary embedding class for it (models/families/), rotate_half (also as a constant matrix, for a fused q/k/v).
A family whose rope turns only the leading dims of a head (partial rotary) gets tables padded with cos 1 and sin 0,
and a rotate_half that leaves the other dims in place, so the same x * cos + rotate_half(x) * sin passes them
through unchanged."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from models.families import family_for
from models.module_options import LlamaShape


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotated dims / 2], attention scaling), from transformers' own rope code so every
    rope_type it knows (llama3 scaling, longrope's short factors included) comes out exactly as Hugging Face
    computes it."""
    rotary = family_for(config).rotary_embedding(config)
    return rotary.inv_freq.float(), float(rotary.attention_scaling)


def _padded(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rest = head_dim - cos.shape[-1]
    if rest == 0:
        return cos, sin
    return F.pad(cos, (0, rest), value=1.0), F.pad(sin, (0, rest), value=0.0)


def rope_at(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
            head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [len(positions), head_dim] in fp32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return _padded(emb.cos() * scaling, emb.sin() * scaling, head_dim or emb.shape[-1])


def rope_tables(config, max_seq_len: int, head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim]: what the family's rotary embedding gives a sequence of that length."""
    rotary = family_for(config).rotary_embedding(config)
    positions = torch.arange(max_seq_len)[None, :]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return _padded(cos[0].float(), sin[0].float(), head_dim or cos.shape[-1])


def rotate_half(x: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Hugging Face's rotate_half on the first rotary_dim dims (all by default); the rest as they are."""
    dim = x.shape[-1]
    rotary_dim = rotary_dim or dim
    half = rotary_dim // 2
    pieces = [-x[..., half:rotary_dim], x[..., :half]]
    return torch.cat(pieces + ([x[..., rotary_dim:]] if rotary_dim < dim else []), dim=-1)


def rotate_half_matrix(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """R with x @ R.T == rotate_half(x, rotary_dim): a signed permutation, so the product is exact."""
    return rotate_half(torch.eye(head_dim), rotary_dim).T.contiguous()


def rope_head_mask(shape: LlamaShape) -> torch.Tensor:
    """[all heads, 1]: 1 on the q and k heads of the fused q/k/v, 0 on the v heads."""
    mask = torch.zeros(shape.n_heads + 2 * shape.n_kv_heads, 1)
    mask[: shape.n_heads + shape.n_kv_heads] = 1.0
    return mask
