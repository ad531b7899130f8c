"""RMSNorm as Hugging Face's Llama computes it (in fp32), or with mean(x²) as a linear for backends that favour it:
the norm of the decoder, of the output and, per head, of q and k."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.module_options import NORM_FORMS


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
