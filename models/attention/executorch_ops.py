"""The attention the custom-op forms share: ExecuTorch's llama::update_cache and llama::custom_sdpa (or, for an
int8 cache, llama::custom_quantized_sdpa), over a cache laid out [1, rows, kv heads, head_dim] as those ops want
it and stored in its own dtype (fp32, fp16, or int8 with a scale and zero point per token and head, as
ExecuTorch's QuantizedKVCache keeps them)."""
from __future__ import annotations

import torch

from models.attention.base import AttentionForm
from models.module_options import ExportOptions, LlamaShape


class ExecutorchOpsAttention(AttentionForm):
    stores_cache_apart = True

    def __init__(self, shape: LlamaShape, options: ExportOptions):
        super().__init__(shape, options)
        self.quantized_cache = options.kv_cache_dtype == "int8"
        if self.quantized_cache:
            qparams_shape = (*self.k_cache.shape[:3], 1)
            for name in ("k", "v"):
                self.register_buffer(f"{name}_cache_scales", torch.zeros(qparams_shape), persistent=False)
                self.register_buffer(f"{name}_cache_zero_points", torch.zeros(qparams_shape, dtype=torch.int8),
                                     persistent=False)

    def _apply(self, fn, recurse=True):
        """A cast of the whole module (an fp16 recipe's) leaves an int8 cache's scales in fp32: the per-token
        quantize ops write them in fp32 and llama::custom_quantized_sdpa reads them so."""
        super()._apply(fn, recurse)
        if self.quantized_cache:
            for name in ("k", "v"):
                scales = getattr(self, f"{name}_cache_scales")
                if scales.dtype != torch.float32:
                    setattr(self, f"{name}_cache_scales", scales.float())
        return self

    @classmethod
    def register_ops(cls, options: ExportOptions) -> None:
        # Registers llama::update_cache / llama::custom_sdpa with torch.
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
        if options.kv_cache_dtype == "int8":
            # The out variants of the per-token quantize ops, which the program's lowering asks torch for.
            import executorch.kernels.quantized  # noqa: F401

    @classmethod
    def cache_rows(cls, options: ExportOptions) -> int:
        return options.cache_rows

    @classmethod
    def cache_shape(cls, shape: LlamaShape, options: ExportOptions) -> tuple[int, ...]:
        return (1, cls.cache_rows(options), shape.n_kv_heads, shape.head_dim)

    def write_cache(self, k, v, start_pos, rows=None) -> None:
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

    def attend_cache(self, q, start_pos, mask=None) -> torch.Tensor:
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


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 values with an fp32 scale and int8 zero point per row of the last dimension (per token and head),
    by ExecuTorch's quantized_decomposed ops, whose kernels ExecuTorch's quantized kernel library has."""
    # Registers the quantized_decomposed ops with torch.
    from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401

    x = x.float()
    scales, zero_points = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    quantized = torch.ops.quantized_decomposed.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return quantized, scales.to(torch.float32), zero_points.to(torch.int8)
