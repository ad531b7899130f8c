"""A Llama decoder with a static KV cache, written for torch.export.

One program serves prefill and decode: forward(tokens[1, T], input_pos[1]) -> logits[1, T, vocab].
The K/V caches are the module's only state (a backend may take them over as its own state; ExecuTorch
plans them as mutable buffers). The forms a backend delegates best are options of this one module
(models/module_options.py: ExportOptions), chosen by the backend (recipes/backends/<backend>.py):
  attention=NAME      how each layer keeps its cache and attends over it: one class per form in
                      models/attention/, picked once when the module is built (form_for)
  norm="hf" | "linear-mean"   RMSNorm as Hugging Face writes it, or with mean(x²) as a linear
  fuse_qkv            q/k/v as one linear
Parameter names match Hugging Face's LlamaForCausalLM so its state dict loads as is (a fused qkv_proj is
concatenated from q_proj, k_proj and v_proj on load).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import form_for
from models.attention.base import AttentionForm
from models.compute_dtype import compute_in
from models.module_options import NORM_FORMS, ExportOptions, LlamaShape
from models.rope import rope_head_mask, rotate_half_matrix

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


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, options: ExportOptions, form: type[AttentionForm]):
        super().__init__()
        self.self_attn = form(shape, options)
        self.mlp = MLP(shape.hidden, shape.intermediate, shape.mlp_bias)
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)

    def forward(self, x, rope, start_pos, positions, mask):
        x = x + self.self_attn(self.input_layernorm(x), rope, start_pos, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, shape: LlamaShape, options: ExportOptions, form: type[AttentionForm]):
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden)
        self.layers = nn.ModuleList(DecoderLayer(shape, options, form) for _ in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)


class LlamaForExport(nn.Module):
    def __init__(self, config, options: ExportOptions):
        super().__init__()
        self.form = form_for(options)
        self.shape = LlamaShape.from_config(config)
        self.options = options
        self.model = _Body(self.shape, options, self.form)
        self.lm_head = nn.Linear(self.shape.hidden, self.shape.vocab_size, bias=False)
        self.form.add_rope_buffers(self, config, options)
        if options.fuse_qkv:
            rotation = rotate_half_matrix(self.shape.head_dim).to(options.dtype)
            self.register_buffer("rope_rotation", rotation, persistent=False)
            self.register_buffer("rope_heads", rope_head_mask(self.shape).to(options.dtype), persistent=False)
        self.form.add_module_buffers(self, options)

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
        start_pos, mask = self.form.start_and_mask(self, positions, input_pos, seq_len)
        cos, sin = self.form.rope(self, positions, dtype)  # [1, T, 1, head_dim]
        if self.options.fuse_qkv:
            # per head of the fused q/k/v: the tables on q and k heads, cos 1 and sin 0 on v heads
            cos = cos * self.rope_heads + (1.0 - self.rope_heads)
            sin = sin * self.rope_heads
        rope = (cos, sin, getattr(self, "rope_rotation", None))
        return rope, start_pos, self.form.layer_positions(self, positions, dtype), mask

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
    return 2 * shape.n_layers * form_for(options).cache_rows(options) * per_row


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
    form_for(options).register_ops(options)
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
    module.form.fill_rope_buffers(module, config, options)
    if options.fuse_qkv:
        module.rope_rotation.copy_(rotate_half_matrix(module.shape.head_dim).to(options.dtype))
        module.rope_heads.copy_(rope_head_mask(module.shape).to(options.dtype))
    module.form.fill_module_buffers(module, options)
