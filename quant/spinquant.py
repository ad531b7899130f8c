"""SpinQuant's R1 (residual stream) and R2 (value/output heads) random Hadamard rotations, applied with
torchao.prototype.spinquant: exact in fp32, they spread outliers across a group. R4 needs an online Hadamard
transform before down_proj, an op the program does not have (quant.algorithms.UNAVAILABLE)."""
from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import torch

from models.errors import UserFacingError
from quant.awq import layer_linears

# The transforms below give the parameters new tensors (`.data =`), as quant/awq.py's do, and change none in
# place: the module's weights are the loaded checkpoint's own tensors, which other recipes still read.


@torch.no_grad()
def fold_norm_weights(module) -> None:
    """Every RMSNorm's weight into the linears after it, leaving a weightless norm, which R1 commutes with.
    (torchao's own fuse_layernorm_into_linear sets the norms to one without folding, and centres the
    embeddings, a LayerNorm step that changes an RMSNorm model.)"""
    pairs = [(layer.input_layernorm, layer_linears(layer)["attention_in"]) for layer in module.model.layers]
    pairs += [(layer.post_attention_layernorm, layer_linears(layer)["mlp_in"]) for layer in module.model.layers]
    pairs += [(module.model.norm, [module.lm_head])]
    for norm, linears in pairs:
        for linear in linears:
            linear.weight.data = linear.weight * norm.weight[None, :]
        norm.weight.data = torch.ones_like(norm.weight)


def _torchao_view(module) -> SimpleNamespace:
    """Our Llama under the attribute names torchao.prototype.spinquant's rotations use (gpt-fast's)."""
    shape = module.shape
    layers = []
    for layer in module.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attention = SimpleNamespace(wo=attn.o_proj)
        if hasattr(attn, "qkv_proj"):
            attention.wqkv = attn.qkv_proj
        else:
            attention.wq, attention.wk, attention.wv = attn.q_proj, attn.k_proj, attn.v_proj
        layers.append(SimpleNamespace(attention=attention, feed_forward=SimpleNamespace(
            w1=mlp.gate_proj, w3=mlp.up_proj, w2=mlp.down_proj)))
    config = SimpleNamespace(dim=shape.n_heads * shape.head_dim, head_dim=shape.head_dim,
                             n_local_heads=shape.n_kv_heads)
    return SimpleNamespace(layers=layers, tok_embeddings=module.model.embed_tokens, output=module.lm_head,
                           config=config)


@torch.no_grad()
def apply_spinquant(module) -> None:
    """R1 rotates the residual stream (embeddings, every linear that reads or writes it, lm_head), R2 each
    value head and o_proj's matching input. The residual stream between layers is then in R1's basis: it is
    kept as `residual_rotation`, so a per-layer comparison with the fp32 model can rotate back."""
    with contextlib.redirect_stdout(sys.stderr):  # it prints a note on import; stdout is the CLI's JSON
        from torchao.prototype.spinquant.hadamard_utils import random_hadamard_matrix
        from torchao.prototype.spinquant.spinquant import _rotate_model_r1, apply_spinquant_r2

    biased = [name for name, linear in module.named_modules() if isinstance(linear, torch.nn.Linear)
              and linear.bias is not None and name.endswith(("v_proj", "qkv_proj", "o_proj", "down_proj"))]
    if biased:
        # R2 turns v's heads and R1 o_proj's and down_proj's outputs; torchao's rotations leave biases as they are
        raise UserFacingError(f"SpinQuant's rotations would leave this model's biases ({biased[0]} and others) "
                              "unrotated and change its output; choose another --quant-algorithm (awq, gptq).")
    view = _torchao_view(module)
    qkv_split = not hasattr(module.model.layers[0].self_attn, "qkv_proj")
    fold_norm_weights(module)
    rotation = random_hadamard_matrix(module.shape.hidden, "cpu")
    _rotate_model_r1(view, rotation, qkv_split=qkv_split)
    apply_spinquant_r2(view, "cpu", qkv_split=qkv_split)
    module.residual_rotation = rotation.to(torch.float32)
