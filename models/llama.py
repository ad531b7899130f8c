"""A Llama decoder with a static KV cache, written for torch.export.

One program serves prefill and decode: forward(tokens[1, T], input_pos[1]) -> logits[1, T, vocab].
The K/V caches are the module's only state (a backend may take them over as its own state; ExecuTorch
plans them as mutable buffers). The forms a backend delegates best are options of this one module, chosen
by the backend (recipes/<backend>.py), never named here:
  attention="sdpa"    aten scaled_dot_product_attention + index_put cache update (portable; eager reference)
  attention="custom"  ExecuTorch's llama::update_cache + llama::custom_sdpa ops (attend only to the filled
                      part of the cache)
  attention="sdpa-slice"  aten SDPA, cache written as one slice at input_pos[0], causal mask built by
                      comparison (no index_put of several positions, no gather of a bool tensor)
  attention="sdpa-onehot" aten SDPA, cache updated by a one-hot matmul + blend and the causal mask made
                      once per call: no int64 index_put in the layers
  norm="hf" | "linear-mean"   RMSNorm as Hugging Face writes it, or with mean(x²) as a linear
  fuse_qkv            q/k/v as one linear
With attention="custom" the caches may be stored apart from the module's dtype (kv_cache_dtype: fp32, fp16, or
int8 per token and head, read by llama::custom_quantized_sdpa), a call may take fewer tokens than the cache holds
(tokens_per_call: prefill goes in chunks), and the cache may be a ring (kv_window): the first
ATTENTION_SINK_TOKENS tokens stay, and every token attends to them and to the kv_window most recent ones.
Parameter names match Hugging Face's LlamaForCausalLM so its state dict loads as is (a fused qkv_proj is
concatenated from q_proj, k_proj and v_proj on load).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.compute_dtype import compute_in

ATTENTION_KINDS = ("sdpa", "custom", "sdpa-slice", "sdpa-onehot")
NORM_FORMS = ("hf", "linear-mean")
KV_CACHE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
# The first tokens a ring cache keeps for good: attention piles up on them (StreamingLLM's attention sinks).
ATTENTION_SINK_TOKENS = 4


@dataclass(frozen=True)
class ExportOptions:
    """Module options only; the pipeline builds them from the recipe's backend."""

    max_seq_len: int = 512
    attention: str = "sdpa"
    norm: str = "hf"
    # q/k/v as one linear (qkv_proj): one weight read, one dynamic activation quantization and one kernel
    # call instead of three each, per layer and token. Per output row the int4 groups are the same as in
    # three linears, so a group-wise scheme quantizes the fused weight exactly alike; a static per-tensor
    # output range, though, would be shared by q, k and v.
    fuse_qkv: bool = False
    dtype: torch.dtype = torch.float32
    # The dtype the decoder layers' linear weights are kept in, when it is not `dtype` (models/compute_dtype.py):
    # an eager fp32 reference on a bf16 checkpoint holds them in bf16. None: `dtype`.
    weight_dtype: torch.dtype | None = None
    # How the K/V caches are stored, a key of KV_CACHE_DTYPES (attention="custom"); None: in `dtype`.
    kv_cache_dtype: str | None = None
    # A ring cache: each token attends to the first ATTENTION_SINK_TOKENS tokens and its kv_window most recent
    # ones, at any position (attention="custom"). None: every token attends to all before it, up to max_seq_len.
    kv_window: int | None = None
    # The most tokens one call takes; a longer prompt is fed in calls of at most this many. None: max_seq_len.
    tokens_per_call: int | None = None

    @property
    def call_tokens(self) -> int:
        """The most tokens one call of the program takes (its token dimension's upper bound)."""
        limit = min(self.max_seq_len, self.tokens_per_call or self.max_seq_len)
        return min(limit, self.kv_window) if self.kv_window else limit

    @property
    def ring_rows(self) -> int:
        """Rows of a ring cache after the sinks: a call's tokens and the kv_window - 1 before its first one, so a
        write never evicts a row a query of the same call still attends to."""
        return self.kv_window + self.call_tokens - 1

    @property
    def cache_rows(self) -> int:
        return ATTENTION_SINK_TOKENS + self.ring_rows if self.kv_window else self.max_seq_len

    @property
    def cache_storage(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] if self.kv_cache_dtype else self.dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, form: str = "hf"):
        super().__init__()
        if form not in NORM_FORMS:
            raise ValueError(f"norm must be one of {NORM_FORMS}, got {form!r}")
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.linear_mean = form == "linear-mean"
        if self.linear_mean:
            # mean(x²) + ε as one fp32 linear, a 1/dim row with ε as its bias: for a backend whose mean
            # needs layout changes around it while its linears are the fastest op it has.
            self.register_buffer("mean_row", torch.empty(1, dim), persistent=False)
            self.register_buffer("eps_bias", torch.empty(1), persistent=False)
            self.fill_constants()

    def fill_constants(self) -> None:
        if self.linear_mean and self.mean_row.device.type != "meta":
            self.mean_row.fill_(1.0 / self.mean_row.shape[1])
            self.eps_bias.fill_(self.eps)

    def _apply(self, fn, recurse=True):
        # The norm computes in fp32 whatever the model's dtype, so a model-wide .to(float16) must leave its
        # constants fp32 and exact.
        super()._apply(fn, recurse)
        if self.linear_mean and self.mean_row.dtype != torch.float32:
            self.mean_row, self.eps_bias = self.mean_row.float(), self.eps_bias.float()
            self.fill_constants()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 like Hugging Face, so fp16 models do not overflow in the variance.
        x32 = x.float()
        if self.linear_mean:
            return self.weight * (x32 * torch.rsqrt(F.linear(x32 * x32, self.mean_row, self.eps_bias))).to(x.dtype)
        # Hugging Face's form: the pattern backends recompose into one rms_norm op.
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_matrix(head_dim: int) -> torch.Tensor:
    """R with x @ R.T == rotate_half(x): a signed permutation, so the product is exact."""
    return rotate_half(torch.eye(head_dim)).T.contiguous()


class Attention(nn.Module):
    def __init__(self, shape: "LlamaShape", options: ExportOptions):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.attention = options.attention
        hidden, bias = shape.hidden, shape.attention_bias
        self.fused_qkv = options.fuse_qkv
        if self.fused_qkv:
            # q, k and v heads from one linear (build_exportable concatenates the checkpoint's weights)
            n_all = self.n_heads + 2 * self.n_kv_heads
            self.qkv_proj = nn.Linear(hidden, n_all * self.head_dim, bias=bias)
        else:
            self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
            self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=bias)
        self.quantized_cache = options.kv_cache_dtype == "int8"
        self.window = options.kv_window
        self.call_tokens = options.call_tokens
        if self.attention == "custom":
            # llama::custom_sdpa wants caches laid out [batch, seq, heads, head_dim].
            cache_shape = (1, options.cache_rows, self.n_kv_heads, self.head_dim)
        else:
            cache_shape = (1, self.n_kv_heads, options.max_seq_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=options.cache_storage), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=options.cache_storage), persistent=False)
        if self.quantized_cache:
            # per token and head, as ExecuTorch's QuantizedKVCache keeps them for llama::custom_quantized_sdpa
            qparams_shape = (*cache_shape[:3], 1)
            for name in ("k", "v"):
                self.register_buffer(f"{name}_cache_scales", torch.zeros(qparams_shape), persistent=False)
                self.register_buffer(f"{name}_cache_zero_points", torch.zeros(qparams_shape, dtype=torch.int8),
                                     persistent=False)

    def forward(self, x, rope, start_pos, positions, mask):
        # x: [1, T, hidden]; rope: cos, sin [1, T, 1 or all heads, head_dim] and, fused, the rotate_half matrix
        # Views say -1 for T rather than a symbolic size: some partitioners delegate only that form.
        bsz, seq_len, _ = x.shape
        cos, sin, rotation = rope
        if self.fused_qkv:
            # Rope on all heads at once, with cos 1 and sin 0 on the v heads (exact: v * 1 + R(v) * 0 == v),
            # then split, so that a partitioner that slices no dynamic-length tensor meets the split only where
            # the attention ops take over.
            qkv = self.qkv_proj(x).view(bsz, -1, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
            # rotate_half as a product with a constant signed permutation: no slice of a dynamic-length tensor,
            # which would cut every layer into two more partitions there.
            qkv = qkv * cos + F.linear(qkv, rotation) * sin
            q, k, v = qkv.split((self.n_heads, self.n_kv_heads, self.n_kv_heads), dim=2)
        else:
            q = self.q_proj(x).view(bsz, -1, self.n_heads, self.head_dim)
            k = self.k_proj(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).view(bsz, -1, self.n_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if self.attention == "custom" and self.window is not None:
            out = self.attend_ring(q, k, v, start_pos, positions, mask)
        elif self.attention == "custom":
            self.write_cache_custom(k, v, start_pos)
            out = self.attend_cache_custom(q, start_pos)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.attention == "sdpa-onehot":
                # positions holds one-hot rows [T, max_seq_len]: the update is a matmul and a blend, all
                # float ops (no int64 index_put), so it stays inside a delegate that takes float ops only.
                keep = 1.0 - positions.sum(0)[:, None]
                self.k_cache.copy_(self.k_cache * keep + torch.matmul(positions.transpose(0, 1), k))
                self.v_cache.copy_(self.v_cache * keep + torch.matmul(positions.transpose(0, 1), v))
            elif self.attention == "sdpa-slice":
                self.k_cache[:, :, start_pos : start_pos + seq_len] = k
                self.v_cache[:, :, start_pos : start_pos + seq_len] = v
            else:
                self.k_cache[:, :, positions] = k
                self.v_cache[:, :, positions] = v
            keys, values = self.k_cache, self.v_cache
            if self.n_kv_heads != self.n_heads and self.attention == "sdpa-onehot":
                # 4-D slices + expand + cat: repeat_interleave goes through a 5-D view
                repeat = self.n_heads // self.n_kv_heads
                keys = torch.cat([keys[:, h : h + 1].expand(-1, repeat, -1, -1) for h in range(self.n_kv_heads)], dim=1)
                values = torch.cat([values[:, h : h + 1].expand(-1, repeat, -1, -1) for h in range(self.n_kv_heads)], dim=1)
            elif self.n_kv_heads != self.n_heads:
                repeat = self.n_heads // self.n_kv_heads
                keys = keys.repeat_interleave(repeat, dim=1)
                values = values.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(bsz, -1, self.n_heads * self.head_dim))

    # The two steps of the custom-ops path, as methods of their own so bench/breakdown.py can time the
    # program without each of them.
    def write_cache_custom(self, k, v, start_pos, rows=None) -> None:
        """k, v [1, T, kv heads, head_dim] into the caches at rows start_pos .. start_pos + T, or at `rows`
        [1, T] (a ring)."""
        for value, name in ((k, "k"), (v, "v")):
            cache = getattr(self, f"{name}_cache")
            if self.quantized_cache:
                quantized, scales, zero_points = quantize_per_token(value)
                parts = ((quantized, cache), (scales, getattr(self, f"{name}_cache_scales")),
                         (zero_points, getattr(self, f"{name}_cache_zero_points")))
            else:
                parts = ((value.to(cache.dtype), cache),)
            for part, buffer in parts:
                if rows is None:
                    torch.ops.llama.update_cache(part, buffer, start_pos)
                else:
                    torch.ops.llama.update_cache_with_indices(part, buffer, start_pos, rows)

    def attend_cache_custom(self, q, start_pos, mask=None) -> torch.Tensor:
        """Causally over cache rows 0 .. start_pos + T, or, given an additive mask [T, cache rows], over the rows
        it leaves open. The attention computes in the caches' float dtype; the result comes back in q's."""
        causal = mask is None
        position = start_pos if causal else 0  # the ops ignore the position when a mask is given
        if self.quantized_cache:
            quantized, scales, zero_points = quantize_per_token(q)
            out = torch.ops.llama.custom_quantized_sdpa(
                quantized, self.k_cache, self.v_cache, position, mask, 0.0, causal, None, zero_points, scales,
                self.k_cache_zero_points, self.k_cache_scales, self.v_cache_zero_points, self.v_cache_scales)
        else:
            out = torch.ops.llama.custom_sdpa(q.to(self.k_cache.dtype), self.k_cache, self.v_cache, position, mask,
                                              0.0, causal)
        return out.to(q.dtype)

    def attend_ring(self, q, k, v, start_pos, positions, mask) -> torch.Tensor:
        """Write and attend for a ring cache. An eager call of more tokens than the program takes (a
        calibration window) goes through in pieces of call_tokens, so that no write evicts a row the same call
        still reads; an exported call has at most call_tokens tokens."""
        seq_len = q.shape[1]
        if isinstance(seq_len, int) and seq_len > self.call_tokens:
            pieces = []
            for first in range(0, seq_len, self.call_tokens):
                part = slice(first, first + self.call_tokens)
                part_positions = positions[part]
                part_mask = ring_mask(part_positions, self.window, self.k_cache.shape[1])
                pieces.append(self.attend_ring(q[:, part], k[:, part], v[:, part], start_pos + first,
                                               part_positions, part_mask))
            return torch.cat(pieces, dim=1)
        self.write_cache_custom(k, v, start_pos, ring_rows(positions, self.k_cache.shape[1])[None, :])
        return self.attend_cache_custom(q, start_pos, mask)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values with an fp32 scale and int8 zero point per row of the last dimension (per token and head),
    by ExecuTorch's quantized_decomposed ops, whose kernels ExecuTorch's quantized kernel library has."""
    # Registers the quantized_decomposed ops with torch.
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401

    x = x.float()
    scales, zero_points = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    quantized = torch.ops.quantized_decomposed.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return quantized, scales.to(torch.float32), zero_points.to(torch.int8)


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


class DecoderLayer(nn.Module):
    def __init__(self, shape: "LlamaShape", options: ExportOptions):
        super().__init__()
        self.self_attn = Attention(shape, options)
        self.mlp = MLP(shape.hidden, shape.intermediate, shape.mlp_bias)
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)

    def forward(self, x, rope, start_pos, positions, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, start_pos, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class LlamaShape:
    """The few numbers of a Hugging Face LlamaConfig this module needs."""

    vocab_size: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config) -> "LlamaShape":
        n_heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            n_layers=config.num_hidden_layers,
            n_heads=n_heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_position_embeddings=config.max_position_embeddings,
        )


class _Body(nn.Module):
    def __init__(self, shape: LlamaShape, options: ExportOptions):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape, options) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)


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


def check_cache_options(options: ExportOptions) -> None:
    """The cache options only the custom ops' attention takes."""
    if options.kv_cache_dtype is not None and options.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {options.kv_cache_dtype!r}")
    if options.attention != "custom" and (options.kv_window or options.cache_storage != options.dtype):
        raise ValueError(f"attention={options.attention!r} keeps its caches whole and in the module's dtype; "
                         "a ring or another cache dtype needs attention='custom'")
    if options.kv_window is not None and options.kv_window < 1:
        raise ValueError(f"kv_window must be at least 1, got {options.kv_window}")


def rope_head_mask(shape: LlamaShape) -> torch.Tensor:
    """[all heads, 1]: 1 on the q and k heads of the fused q/k/v, 0 on the v heads."""
    mask = torch.zeros(shape.n_heads + 2 * shape.n_kv_heads, 1)
    mask[: shape.n_heads + shape.n_kv_heads] = 1.0
    return mask


class LlamaForExport(nn.Module):
    def __init__(self, config, options: ExportOptions):
        super().__init__()
        if options.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {options.attention!r}")
        check_cache_options(options)
        self.shape = LlamaShape.from_config(config)
        self.options = options
        self.model = _Body(self.shape, options)
        self.lm_head = nn.Linear(self.shape.hidden, self.shape.vocab_size, bias=False)
        if options.kv_window:
            # a ring takes any position: its rope angles are computed per call, not looked up in a table
            inv_freq, self.rope_scaling = rope_frequencies(config)
            self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        else:
            cos, sin = rope_tables(config, options.max_seq_len)
            self.register_buffer("rope_cos", cos.to(options.dtype), persistent=False)
            self.register_buffer("rope_sin", sin.to(options.dtype), persistent=False)
        if options.fuse_qkv:
            rotation = rotate_half_matrix(self.shape.head_dim).to(options.dtype)
            self.register_buffer("rope_rotation", rotation, persistent=False)
            self.register_buffer("rope_heads", rope_head_mask(self.shape).to(options.dtype), persistent=False)
        if options.attention == "sdpa":
            causal = torch.tril(torch.ones(options.max_seq_len, options.max_seq_len, dtype=torch.bool))
            self.register_buffer("causal_mask", causal, persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        arguments = self.layer_arguments(tokens.shape[1], input_pos, x.dtype)
        for layer in self.model.layers:
            x = layer(x, *arguments)
        return self.lm_head(self.model.norm(x))

    def layer_arguments(self, seq_len: int, input_pos: torch.Tensor, dtype: torch.dtype) -> tuple:
        """What every decoder layer is called with besides the hidden state, for a call of `seq_len` tokens at
        input_pos: (rope, start_pos, positions, mask), made once per call rather than in every layer."""
        positions = input_pos + torch.arange(seq_len, dtype=torch.long)
        if self.options.attention in ("custom", "sdpa-slice"):
            start_pos = input_pos[0].item()
            torch._check(start_pos >= 0)
            if not self.options.kv_window:
                torch._check(start_pos + seq_len <= self.options.max_seq_len)
        if self.options.kv_window:
            mask = ring_mask(positions, self.options.kv_window, self.options.cache_rows)
        elif self.options.attention == "custom":
            mask = None
        elif self.options.attention == "sdpa-slice":
            mask = torch.arange(self.options.max_seq_len)[None, :] <= positions[:, None]
        elif self.options.attention == "sdpa-onehot":
            start_pos = None
            mask = torch.arange(self.options.max_seq_len)[None, :] <= positions[:, None]
        else:
            start_pos = None
            mask = self.causal_mask.index_select(0, positions)
        # [1, T, 1, head_dim]
        if self.options.kv_window:
            cos, sin = rope_at(positions, self.rope_inv_freq, self.rope_scaling)
            cos, sin = cos.to(dtype).view(1, -1, 1, self.shape.head_dim), sin.to(dtype).view(1, -1, 1, self.shape.head_dim)
        else:
            cos = self.rope_cos.index_select(0, positions).view(1, -1, 1, self.shape.head_dim)
            sin = self.rope_sin.index_select(0, positions).view(1, -1, 1, self.shape.head_dim)
        if self.options.fuse_qkv:
            # per head of the fused q/k/v: the tables on q and k heads, cos 1 and sin 0 on v heads
            cos = cos * self.rope_heads + (1.0 - self.rope_heads)
            sin = sin * self.rope_heads
        rope = (cos, sin, getattr(self, "rope_rotation", None))
        if self.options.attention == "sdpa-onehot":
            # made here, so the integer ops stay outside the layers the backend takes whole
            positions = (torch.arange(self.options.max_seq_len)[None, :] == positions[:, None]).to(dtype)
        return rope, start_pos, positions, mask

    def reset_cache(self) -> None:
        for layer in self.model.layers:
            for name, buffer in layer.self_attn.named_buffers():
                if name.startswith(("k_cache", "v_cache")):
                    buffer.zero_()


def kv_cache_bytes(shape: LlamaShape, options: ExportOptions) -> int:
    """Bytes of the module's K/V caches, as its buffers hold them: every layer's k and v rows in their storage
    dtype, and for int8 an fp32 scale and an int8 zero point per row and head."""
    per_row = shape.n_kv_heads * shape.head_dim * options.cache_storage.itemsize
    if options.kv_cache_dtype == "int8":
        per_row += shape.n_kv_heads * (4 + 1)
    rows = options.cache_rows if options.attention == "custom" else options.max_seq_len
    return 2 * shape.n_layers * rows * per_row


def checkpoint_tensors(config) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors the module reads for this config, and their shapes (lm_head.weight among them)."""
    with torch.device("meta"):
        module = LlamaForExport(config, ExportOptions(max_seq_len=1))
    return {name: tuple(parameter.shape) for name, parameter in module.named_parameters()}


def checkpoint_names(name: str) -> list[str]:
    """The checkpoint tensors one parameter of this module is made of: Hugging Face's names, and for the
    fused qkv_proj its q_proj, k_proj and v_proj, concatenated in that order (rows q, k, v)."""
    if ".self_attn.qkv_proj." in name:
        return [name.replace(".qkv_proj.", f".{proj}.") for proj in ("q_proj", "k_proj", "v_proj")]
    return [name]


def _units(module: LlamaForExport, output_first: bool = False) -> list[tuple[str, nn.Module]]:
    """The pieces the module is filled (and quantized) in, one after the other: embedding, each decoder
    layer, final norm, output layer; with output_first the output layer comes right after the embedding."""
    body = module.model
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(body.layers)]
    output = [("lm_head", module.lm_head)]
    return [("model.embed_tokens", body.embed_tokens), *(output if output_first else []), *layers,
            ("model.norm", body.norm), *([] if output_first else output)]


def _read(weights: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    read = getattr(weights, "read", None)  # a lazy checkpoint copies one tensor out of its file, in `dtype`
    return read(name, dtype) if read is not None else weights[name].to(dtype)


def build_exportable(config, state_dict: Mapping[str, torch.Tensor], options: ExportOptions,
                     transform_unit: Callable[[nn.Module, "LlamaForExport"], None] | None = None,
                     tie_output: bool = False, output_first: bool = False) -> LlamaForExport:
    """A fresh module with the checkpoint's weights in options.dtype, filled one unit (embedding, decoder
    layer, norm, output layer) at a time: each tensor is read, cast and assigned, then `transform_unit(unit,
    module)` runs (a quantization, which replaces the unit's float weights; the module's buffers are filled,
    the units after this one are still on meta), so at most one unit is ever held in float beyond what the
    transform keeps. With tied embeddings lm_head gets its own copy, so embedding and output layer can be
    quantized differently; `tie_output` shares the embedding instead (no transform). output_first: fill the output
    layer right after the embedding, so a transform that shrinks it (a quantization) holds the vocabulary-wide
    float matrix beside the embedding alone rather than beside every quantized decoder layer."""
    if options.attention == "custom":
        # Registers llama::update_cache / llama::custom_sdpa with torch.
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    if options.kv_cache_dtype == "int8":
        # The out variants of the per-token quantize ops, which the program's lowering asks torch for.
        import executorch.kernels.quantized  # noqa: F401
    if tie_output and transform_unit is not None:
        raise ValueError("tie_output shares one tensor between two units, which a transform would quantize apart")
    # Built on meta so a 1B model does not first allocate random weights it then overwrites.
    with torch.device("meta"):
        module = LlamaForExport(config, options)
    available = {k for k in state_dict if not k.endswith("rotary_emb.inv_freq")}
    tied = "lm_head.weight" not in available and "model.embed_tokens.weight" in available
    sources = {name: ["model.embed_tokens.weight"] if name == "lm_head.weight" and tied else checkpoint_names(name)
               for name, _ in module.named_parameters()}
    missing = [s for names in sources.values() for s in names if s not in available]
    unexpected = sorted(available - {s for names in sources.values() for s in names})
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the Llama layout: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    _fill_buffers(module, config, options)
    for prefix, unit in _units(module, output_first):
        for local_name, meta in list(unit.named_parameters()):
            name = f"{prefix}.{local_name}"
            owner_name, _, attr = local_name.rpartition(".")
            owner = unit.get_submodule(owner_name) if owner_name else unit
            if name == "lm_head.weight" and tied and tie_output:
                tensor = module.model.embed_tokens.weight.data
            else:
                # The vocabulary-sized matrix stays in `dtype`: its scratch would be as large as itself.
                keep_stored = prefix.startswith("model.layers.") and isinstance(owner, nn.Linear) and attr == "weight"
                dtype = options.weight_dtype if options.weight_dtype and keep_stored else options.dtype
                parts = [_read(state_dict, source, dtype) for source in sources[name]]
                tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                del parts
                if name == "lm_head.weight" and tied and not hasattr(state_dict, "read"):
                    tensor = tensor.clone()  # a dict's .to() may hand back the embedding tensor itself
            if tensor.shape != meta.shape:
                raise ValueError(f"checkpoint tensor {name} is {tuple(tensor.shape)}, the config says {tuple(meta.shape)}")
            owner._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
            del tensor
        if transform_unit is not None:
            transform_unit(unit, module)
    if options.weight_dtype not in (None, options.dtype):
        compute_in(module, options.dtype)
    return module.eval()


def _fill_buffers(module: LlamaForExport, config, options: ExportOptions) -> None:
    """The module's non-weight state (K/V caches, rope tables, norm constants, mask) made real."""
    for name, buf in list(module.named_buffers()):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._buffers[attr] = torch.zeros(buf.shape, dtype=buf.dtype)
    for norm in module.modules():
        if isinstance(norm, RMSNorm):
            norm.fill_constants()
    if options.kv_window:
        module.rope_inv_freq.copy_(rope_frequencies(config)[0])
    else:
        cos, sin = rope_tables(config, options.max_seq_len)
        module.rope_cos.copy_(cos.to(options.dtype))
        module.rope_sin.copy_(sin.to(options.dtype))
    if options.fuse_qkv:
        module.rope_rotation.copy_(rotate_half_matrix(module.shape.head_dim).to(options.dtype))
        module.rope_heads.copy_(rope_head_mask(module.shape).to(options.dtype))
    if options.attention == "sdpa":
        module.causal_mask.copy_(torch.tril(torch.ones_like(module.causal_mask)))
