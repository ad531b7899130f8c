"""What the exported module is built from: its options (ExportOptions, chosen by a backend) and the few numbers of
a Hugging Face LlamaConfig it reads (LlamaShape). Kept apart from models/llama.py so the attention forms
(models/attention/) read them without importing the module that builds them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class LlamaShape:
    """The few numbers of a Hugging Face LlamaConfig this module needs, and the choices by which a Llama-like
    family's module differs from Llama's (models/families/ fills those from its config)."""

    vocab_size: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool  # on o_proj, and on q/k/v unless qkv_bias says otherwise
    mlp_bias: bool
    max_position_embeddings: int
    qkv_bias: bool | None = None  # None: as attention_bias
    # an RMSNorm over each head of q and of k (q_norm, k_norm: head_dim weights), before rope
    qk_norm: bool = False
    # per layer, whether it applies rope (None: every layer does)
    rope_layers: tuple[bool, ...] | None = None
    # the leading dims of each head that rope rotates (None: all of head_dim); the rest pass through
    rotary_dim: int | None = None
    # each token attends to at most this many most recent tokens (itself included); None: to all before it
    sliding_window: int | None = None

    @property
    def q_k_v_bias(self) -> bool:
        return self.attention_bias if self.qkv_bias is None else self.qkv_bias

    @property
    def rotated_dims(self) -> int:
        return self.rotary_dim or self.head_dim

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

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
            sliding_window=sliding_window(config),
        )


def sliding_window(config) -> int | None:
    """The attention window of a config whose layers (all, or those layer_types marks) attend to a sliding window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)
