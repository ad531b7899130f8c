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
concatenated from q_proj, k_proj and v_proj on load). A Llama-like family (models/families/) differs through the
choices of its LlamaShape (a q/k/v bias, a norm on q and k, layers without rope, partial rope, a sliding window),
its tensor names (fused tensors split by rows) and exact weight folds, all applied here when the module is built.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import form_for
from models.attention.base import AttentionForm, rope_on_fused
from models.compute_dtype import compute_in
from models.errors import UserFacingError
from models.families import family_for
from models.module_options import ExportOptions, LlamaShape
from models.rms_norm import RMSNorm
from models.rope import rope_head_mask, rotate_half_matrix

class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, options: ExportOptions, form: type[AttentionForm], index: int):
        super().__init__()
        self.self_attn = form(shape, options)
        self.self_attn.use_rope = shape.uses_rope(index)
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
        self.layers = nn.ModuleList(DecoderLayer(shape, options, form, i) for i in range(shape.n_layers))
        self.norm = RMSNorm(shape.hidden, shape.rms_norm_eps, options.norm)


class LlamaForExport(nn.Module):
    def __init__(self, config, options: ExportOptions):
        super().__init__()
        self.form = form_for(options)
        self.shape = family_for(config).shape(config)
        self.options = options
        window = self.shape.sliding_window
        if window is not None and options.max_seq_len > window:
            raise UserFacingError(f"a context of {options.max_seq_len} tokens is beyond this model's sliding attention "
                                  f"window of {window} tokens, which Lowerbench does not compute; choose at most "
                                  f"{window} (--max-seq-len), or a ring of recent tokens (--kv-cache-window).")
        self.model = _Body(self.shape, options, self.form)
        self.lm_head = nn.Linear(self.shape.hidden, self.shape.vocab_size, bias=False)
        self.form.add_rope_buffers(self, config, options)
        if options.fuse_qkv:
            rotation = rotate_half_matrix(self.shape.head_dim, self.shape.rotary_dim).to(options.dtype)
            self.register_buffer("rope_rotation", rotation, persistent=False)
        if rope_on_fused(self.shape, options):
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
        if rope_on_fused(self.shape, self.options):
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
    """The checkpoint tensors the module reads for this config, by the names its family stores them under, and
    their shapes (lm_head.weight among them; a fused tensor as tall as its parts together)."""
    family = family_for(config)
    with torch.device("meta"):
        module = LlamaForExport(config, ExportOptions(max_seq_len=1))
    found: dict[str, tuple[int, ...]] = {}
    for name, parameter in module.named_parameters():
        source, rows = family.source(name, module.shape)
        if rows is None:
            found[source] = tuple(parameter.shape)
        else:
            found[source] = (max(found.get(source, (0,))[0], rows.stop), *parameter.shape[1:])
    return found


def llama_names(name: str) -> list[str]:
    """The Llama-named tensors one parameter of this module is made of: itself, or for the fused qkv_proj its
    q_proj, k_proj and v_proj, concatenated in that order (rows q, k, v)."""
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
    family = family_for(config)
    available = {k for k in state_dict if not k.endswith("rotary_emb.inv_freq")}
    tied = "lm_head.weight" not in available and "model.embed_tokens.weight" in available
    # each parameter's pieces: (checkpoint tensor, its rows or None for all, the piece's Llama name)
    sources = {name: [("model.embed_tokens.weight", None, name)] if name == "lm_head.weight" and tied
               else [(*family.source(llama, module.shape), llama) for llama in llama_names(name)]
               for name, _ in module.named_parameters()}
    needed = {source for pieces in sources.values() for source, _, _ in pieces}
    missing = sorted(needed - available)
    unexpected = sorted(available - needed)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {family.name} layout: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    # a folded output layer is no longer the embedding it is tied to
    fold = functools.partial(family.fold, config)
    share_output = tie_output and fold("lm_head.weight") == fold("model.embed_tokens.weight")
    _fill_buffers(module, config, options)
    for prefix, unit in _units(module, output_first):
        for local_name, meta in list(unit.named_parameters()):
            name = f"{prefix}.{local_name}"
            owner_name, _, attr = local_name.rpartition(".")
            owner = unit.get_submodule(owner_name) if owner_name else unit
            if name == "lm_head.weight" and tied and share_output:
                tensor = module.model.embed_tokens.weight.data
            else:
                # The vocabulary-sized matrix stays in `dtype`: its scratch would be as large as itself.
                keep_stored = prefix.startswith("model.layers.") and isinstance(owner, nn.Linear) and attr == "weight"
                dtype = options.weight_dtype if options.weight_dtype and keep_stored else options.dtype
                tensor = _assemble(state_dict, sources[name], dtype, fold)
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


def _assemble(state_dict: Mapping[str, torch.Tensor], pieces: list[tuple[str, slice | None, str]],
              dtype: torch.dtype, fold: Callable[[str], float]) -> torch.Tensor:
    """One parameter from its pieces: each checkpoint tensor read once, cut to its rows, folded, then joined."""
    read: dict[str, torch.Tensor] = {}
    parts = []
    for source, rows, llama in pieces:
        if source not in read:
            read[source] = _read(state_dict, source, dtype)
        part = read[source] if rows is None else read[source][rows]
        factor = fold(llama)
        if factor != 1.0:
            part = (part.float() * factor).to(dtype)
        elif rows is not None and len(pieces) == 1:
            part = part.clone()  # rows of their own, not a view that keeps the whole fused tensor alive
        parts.append(part)
    del read
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


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
        module.rope_rotation.copy_(rotate_half_matrix(module.shape.head_dim, module.shape.rotary_dim).to(options.dtype))
    if rope_on_fused(module.shape, options):
        module.rope_heads.copy_(rope_head_mask(module.shape).to(options.dtype))
    module.form.fill_module_buffers(module, options)
