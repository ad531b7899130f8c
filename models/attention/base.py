"""What every attention form shares: the q/k/v projections, a norm on q and k, rope on them, the output projection,
and the registry the forms join. A form says how its cache is laid out and written, how a layer attends over it, and
what a call makes once for every layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.module_options import ExportOptions, LlamaShape
from models.rms_norm import RMSNorm
from models.rope import rope_tables, rotate_half

FORMS: dict[tuple[str, bool], type["AttentionForm"]] = {}


def form(name: str, ring: bool = False):
    """Registers a form under the name ExportOptions.attention gives, for a whole cache or a ring."""
    def register(cls):
        cls.form_name, cls.ring = name, ring
        FORMS[(name, ring)] = cls
        return cls
    return register


def rope_on_fused(shape: LlamaShape, options: ExportOptions) -> bool:
    """Whether rope turns the fused q/k/v as one tensor (its tables then cover every head)."""
    return options.fuse_qkv and not shape.qk_norm


class AttentionForm(nn.Module):
    form_name: str = ""
    ring: bool = False
    # whether the cache may be stored in another dtype than the module's (ExportOptions.kv_cache_dtype)
    stores_cache_apart: bool = False

    def __init__(self, shape: LlamaShape, options: ExportOptions):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        hidden, bias = shape.hidden, shape.q_k_v_bias
        self.fused_qkv = options.fuse_qkv
        if self.fused_qkv:
            # q, k and v heads from one linear (build_exportable concatenates the checkpoint's weights)
            n_all = self.n_heads + 2 * self.n_kv_heads
            self.qkv_proj = nn.Linear(hidden, n_all * self.head_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
            self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=shape.attention_bias)
        self.qk_norm = shape.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps, options.norm)
            self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps, options.norm)
        self.rotary_dim = shape.rotary_dim
        # rope on the fused q/k/v before the split; a norm on q and k comes first, so it then waits for the split
        self.rope_on_fused = rope_on_fused(shape, options)
        self.use_rope = True  # the decoder layer turns it off for a layer without rope
        cache_shape = self.cache_shape(shape, options)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=options.cache_storage), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=options.cache_storage), persistent=False)

    @classmethod
    def register_ops(cls, options: ExportOptions) -> None:
        """Registers with torch the operators this form's layers call, before a module is built."""

    @classmethod
    def cache_rows(cls, options: ExportOptions) -> int:
        return options.max_seq_len

    @classmethod
    def cache_shape(cls, shape: LlamaShape, options: ExportOptions) -> tuple[int, ...]:
        return (1, shape.n_kv_heads, cls.cache_rows(options), shape.head_dim)

    def forward(self, x, rope, start_pos, positions, mask):
        # x: [1, T, hidden]; rope: cos, sin [1, T, 1 or all heads, head_dim] and, fused, the rotate_half matrix
        bsz = x.shape[0]
        q, k, v = self.project(x, rope)
        out = self.attend(q, k, v, start_pos, positions, mask)
        return self.o_proj(out.reshape(bsz, -1, self.n_heads * self.head_dim))

    def project(self, x, rope):
        """q [1, T, heads, head_dim], k and v [1, T, kv heads, head_dim] of x [1, T, hidden]: projected, q and k
        normed where the model norms them, then rotated (rope: cos, sin and, fused, the rotate_half matrix)."""
        # Views say -1 for T rather than a symbolic size: some partitioners delegate only that form.
        bsz = x.shape[0]
        cos, sin, rotation = rope
        if self.fused_qkv:
            # Rope on all heads at once, with cos 1 and sin 0 on the v heads (exact: v * 1 + R(v) * 0 == v),
            # then split, so that a partitioner that slices no dynamic-length tensor meets the split only where
            # the attention ops take over.
            qkv = self.qkv_proj(x).view(bsz, -1, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
            if self.use_rope and self.rope_on_fused:
                qkv = self.rotate(qkv, cos, sin, rotation)
            q, k, v = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=2)
        else:
            q = self.q_proj(x).view(bsz, -1, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope and not self.rope_on_fused:
            q, k = self.rotate(q, cos, sin, rotation), self.rotate(k, cos, sin, rotation)
        return q, k, v

    def rotate(self, x, cos, sin, rotation):
        # rotate_half as a product with a constant signed permutation where one is given: no slice of a
        # dynamic-length tensor, which would cut every layer into two more partitions there.
        turned = rotate_half(x, self.rotary_dim) if rotation is None else F.linear(x, rotation)
        return x * cos + turned * sin

    def attend(self, q, k, v, start_pos, positions, mask) -> torch.Tensor:
        """q [1, T, heads, head_dim], k and v [1, T, kv heads, head_dim] -> [1, T, heads, head_dim], the cache
        written on the way."""
        raise NotImplementedError

    # What a call makes once, on the whole module, for every layer.
    @classmethod
    def add_rope_buffers(cls, module: nn.Module, config, options: ExportOptions) -> None:
        """cos/sin tables of every position the cache holds."""
        cos, sin = rope_tables(config, options.max_seq_len, module.shape.head_dim)
        module.register_buffer("rope_cos", cos.to(options.dtype), persistent=False)
        module.register_buffer("rope_sin", sin.to(options.dtype), persistent=False)

    @classmethod
    def fill_rope_buffers(cls, module: nn.Module, config, options: ExportOptions) -> None:
        cos, sin = rope_tables(config, options.max_seq_len, module.shape.head_dim)
        module.rope_cos.copy_(cos.to(options.dtype))
        module.rope_sin.copy_(sin.to(options.dtype))

    @classmethod
    def rope(cls, module: nn.Module, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [1, T, 1, head_dim] at `positions`."""
        head_dim = module.shape.head_dim
        return (module.rope_cos.index_select(0, positions).view(1, -1, 1, head_dim),
                module.rope_sin.index_select(0, positions).view(1, -1, 1, head_dim))

    @classmethod
    def add_module_buffers(cls, module: nn.Module, options: ExportOptions) -> None:
        """Buffers the form keeps on the module rather than in each layer."""

    @classmethod
    def fill_module_buffers(cls, module: nn.Module, options: ExportOptions) -> None:
        """Those buffers made real once the module leaves the meta device."""

    @classmethod
    def start_and_mask(cls, module: nn.Module, positions: torch.Tensor, input_pos: torch.Tensor, seq_len: int):
        """(start_pos, mask) for a call of seq_len tokens at `positions`, passed to every layer."""
        raise NotImplementedError

    @classmethod
    def layer_positions(cls, module: nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The positions as the layers take them."""
        return positions

    @staticmethod
    def checked_start(input_pos: torch.Tensor, seq_len: int, options: ExportOptions, bounded: bool):
        """input_pos[0] as an int the exporter can reason about; within the cache when `bounded`."""
        start_pos = input_pos[0].item()
        torch._check(start_pos >= 0)
        if bounded:
            torch._check(start_pos + seq_len <= options.max_seq_len)
        return start_pos


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention written out (q @ k^T * scale, + additive mask, softmax, @ v) with each kv head's query heads
    reshaped into one group, so the kv heads are never copied: q [1, heads, T, head_dim], keys and values
    [1, kv heads, rows, head_dim], mask broadcastable to [1, heads, T, rows] -> [1, heads, T, head_dim]. Core ML
    computes fused SDPA wrong on iOS 26, and the copies of repeat_interleave cost time (ExecuTorch's static
    attention, decompose_sdpa_in_mha)."""
    _, heads, _, head_dim = q.shape
    kv_heads, rows = keys.shape[1], keys.shape[2]
    grouped = q.reshape(1, kv_heads, -1, head_dim)  # the query heads of kv head h are h * group .. (h + 1) * group
    scores = torch.matmul(grouped, keys.transpose(-2, -1)) * head_dim ** -0.5
    weights = torch.softmax(scores.view(1, heads, -1, rows) + mask, dim=-1)
    return torch.matmul(weights.view(1, kv_heads, -1, rows), values).view(1, heads, -1, head_dim)
