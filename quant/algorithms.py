"""How an int4 group-wise scheme picks its weights and qparams: the `quant_algorithm` recipe option.

Every algorithm ends in the same torchao tensors (int4 groups with one scale each), so the program, its ops
and its bytes per token are those of `minmax`; only the numbers differ.
  minmax     each group's scale from its absolute maximum (torchao's choose_qparams_affine)
  hqq        HQQ's scale-only optimisation of each group's scale (torchao's HQQ_SCALE_ONLY qparams)
  awq        activation-aware scales (torchao.prototype.awq's AWQObserver search on the calibration text, one
             decoder layer at a time: quant/awq.py), folded into the op before each linear so the program gains
             no op; the scaled weights then take HQQ's group scales
  spinquant  SpinQuant's R1 (residual stream) and R2 (value/output heads) random Hadamard rotations, applied
             with torchao.prototype.spinquant; exact in fp32, they spread outliers across a group
  gptq       GPTQ's column-by-column error compensation against each linear's Hessian on the calibration text
             (quant/gptq.py: torchao's GPTQ observer, a CPU loop for symmetric int4 groups)
  awq-gptq   AWQ's scales folded in first, then GPTQ on the scaled weights
"""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch

from quant.awq import layer_linears

ALGORITHMS: dict[str, str] = {
    "minmax": "scales from each group's min/max",
    "hqq": "HQQ scale-only qparams (torchao)",
    "awq": "activation-aware weight scales searched on the calibration text (torchao AWQ), folded into norms, "
           "then HQQ scale-only qparams",
    "spinquant": "SpinQuant R1 + R2 Hadamard rotations (torchao), exact in fp32",
    "gptq": "GPTQ error compensation on the calibration text's Hessians (torchao's observer), layer by layer",
    "awq-gptq": "AWQ's scales (torchao) folded in, then GPTQ",
}
CALIBRATED = ("awq", "gptq", "awq-gptq")
# Algorithms that begin with AWQ's scale search.
AWQ_ALGORITHMS = ("awq", "awq-gptq")
# Algorithms whose int4 linears GPTQ quantizes (quant/gptq.py), after their fp32 transform.
GPTQ_ALGORITHMS = ("gptq", "awq-gptq")
# Calibration tokens GPTQ's Hessians are taken over, when an algorithm reads more than quant.calibration's
# default (which AWQ's search and the mixed-precision search keep to). The Hessians are as wide as the MLP: on a
# few thousand tokens they are near singular and GPTQ fits the calibration text (docs/quantization.md).
GPTQ_CALIBRATION_TOKENS = 8192
ALGORITHM_CALIBRATION_TOKENS = {"gptq": GPTQ_CALIBRATION_TOKENS, "awq-gptq": GPTQ_CALIBRATION_TOKENS}

# Asked for, not offered on this stack, and why.
UNAVAILABLE: dict[str, str] = {
    "spinquant-r4": "SpinQuant's R4 needs an online Hadamard transform before down_proj, an op the program does not "
                    "have; spinquant applies R1 and R2, which fold into the weights",
}

# Algorithms whose int4 groups end with HQQ's scales. AWQ's scales change which weights matter, not how a
# group's scale is fitted, so HQQ's fit still helps after them (measured on the built-in model, README).
HQQ_QPARAMS = ("hqq", "awq")
# What AWQ's scale search quantizes each candidate with: min/max groups, because HQQ's fit inside every one
# of its candidates would repeat the whole HQQ pass once per candidate.
AWQ_SEARCH_QPARAMS = "minmax"


def qparams_algorithm(algorithm: str):
    """torchao's IntxChooseQParamsAlgorithm for an algorithm's final groups: HQQ's, or the affine min/max."""
    from torchao.quantization.quantize_.workflows.intx.intx_choose_qparams_algorithm import (
        IntxChooseQParamsAlgorithm,
    )

    return IntxChooseQParamsAlgorithm.HQQ_SCALE_ONLY if algorithm in HQQ_QPARAMS else IntxChooseQParamsAlgorithm.AFFINE


# Weight elements per call of torchao's HQQ fit under hqq_by_cache_sized_rows. Its temporaries, a few fp32
# copies of what it fits, then stay in a CPU's cache, and below malloc's mmap threshold (malloc_policy.py), so
# they are reused from the heap rather than mapped and faulted in afresh on each of its iterations.
HQQ_BLOCK_ELEMENTS = 1 << 17


@contextmanager
def hqq_by_cache_sized_rows():
    """torchao's HQQ scale-only fit, called on a block of rows at a time inside the block.

    Each of its iterations sweeps the weight several times in fp32; over a whole decoder matrix every sweep goes
    to memory through freshly mapped temporaries, over a block of rows it stays in cache, several times faster.
    Groups run along a row, so each block's scales and integers are those of the whole call (a test checks they
    are equal)."""
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    whole = intx._choose_qparams_and_quantize_scale_only_hqq

    def by_rows(hp_tensor, block_size, qmin, qmax, **kwargs):
        rows = max(1, HQQ_BLOCK_ELEMENTS // hp_tensor.shape[-1])
        if hp_tensor.shape[0] <= rows:
            return whole(hp_tensor, block_size, qmin, qmax, **kwargs)
        parts = [whole(hp_tensor[start:start + rows], block_size, qmin, qmax, **kwargs)
                 for start in range(0, hp_tensor.shape[0], rows)]
        return torch.cat([qdata for qdata, _ in parts]), torch.cat([scale for _, scale in parts])

    intx._choose_qparams_and_quantize_scale_only_hqq = by_rows
    try:
        yield
    finally:
        intx._choose_qparams_and_quantize_scale_only_hqq = whole


def check_algorithm(scheme: str, algorithm: str, offered: tuple[str, ...]) -> None:
    from models.errors import UserFacingError

    if algorithm in offered:
        return
    from quant.schemes import SCHEMES

    why = UNAVAILABLE.get(algorithm)
    if why is None and algorithm in ALGORITHMS:
        pt2e = SCHEMES[scheme].quantize_exported is not None and SCHEMES[scheme].int4_config is not None
        if pt2e and algorithm == "spinquant":
            why = (f"SpinQuant's rotations gave a larger error than minmax under {scheme}'s PT2E quantizer, whose "
                   "16-bit activations leave it only the weights' outliers to spread")
        elif pt2e and algorithm in GPTQ_ALGORITHMS:
            why = (f"{scheme}'s PT2E quantizer sets the qparams from its observers after the float weights are "
                   "fixed; GPTQ chooses the integers itself")
        elif pt2e:
            why = (f"the backend's PT2E quantizer sets {scheme}'s qparams from its observers; only algorithms that "
                   "transform the float weights before it are offered")
        else:
            why = f"{scheme} has no int4 group-wise weights"
    raise UserFacingError(
        f"quant algorithm {algorithm!r} is not offered for {scheme}" + (f" ({why})" if why else "")
        + f"; choose one of: {', '.join(offered)}."
    )


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
    import contextlib
    import sys

    with contextlib.redirect_stdout(sys.stderr):  # it prints a note on import; stdout is the CLI's JSON
        from torchao.prototype.spinquant.hadamard_utils import random_hadamard_matrix
        from torchao.prototype.spinquant.spinquant import _rotate_model_r1, apply_spinquant_r2

    view = _torchao_view(module)
    qkv_split = not hasattr(module.model.layers[0].self_attn, "qkv_proj")
    fold_norm_weights(module)
    rotation = random_hadamard_matrix(module.shape.hidden, "cpu")
    _rotate_model_r1(view, rotation, qkv_split=qkv_split)
    apply_spinquant_r2(view, "cpu", qkv_split=qkv_split)
    module.residual_rotation = rotation.to(torch.float32)


def prepare_weights(module, algorithm: str, weight_config, calibration: list[torch.Tensor] | None) -> None:
    """The fp32 transform an algorithm makes before quantize_ (none for minmax, hqq and gptq)."""
    if algorithm in AWQ_ALGORITHMS:
        if not calibration:
            raise ValueError(f"{algorithm} needs calibration windows")
        from quant.awq import apply_awq

        apply_awq(module, weight_config, calibration)
    elif algorithm == "spinquant":
        apply_spinquant(module)
