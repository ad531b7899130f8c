"""AWQ's activation-aware scales (torchao.prototype.awq's AWQObserver), one decoder layer at a time.

A layer's scales come from the inputs its linears see on the calibration text; folding them into the op
before each linear leaves the layer's function as it was, so the hidden states a layer passes on are the
float model's whether its scales are folded yet or not. A layer can therefore be searched as soon as it is
built and before it is quantized, from the hidden states the layers before it passed on: the whole float
model is never needed (AwqAsBuilt), and a whole float module gets the same scales layer by layer (apply_awq).
"""
from __future__ import annotations

import torch
from torch import nn

AWQ_SCALE_CANDIDATES = 20  # torchao's default search space
# What AwqAsBuilt's search on a decoder layer holds beside the float layer, in fp32 copies of the linears reading
# the layer's widest input (gate and up concatenated): torchao's observer concatenates them, and each candidate
# scales, quantizes, dequantizes and multiplies them, with torchao's temporaries. Fit to the peak of an
# export-only job at Llama-3.2-1B's shape (recipes/memory_estimate.py counts it).
AWQ_SEARCH_COPIES = 15


def layer_linears(layer) -> dict[str, list[nn.Linear]]:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    return {"attention_in": qkv, "mlp_in": [mlp.gate_proj, mlp.up_proj], "mlp_out": [mlp.down_proj]}


# The transforms below give the parameters new tensors (`.data =`) and change none in place: the module's
# weights are the loaded checkpoint's own tensors, which the fp32 reference and the other recipes still read.


@torch.no_grad()
def fold_input_scale(owner: nn.Module, linears: list[nn.Linear], scale: torch.Tensor) -> None:
    """x -> x / scale in the op that makes the linears' input (a norm's weight, or up_proj's rows for
    down_proj), and W -> W * scale in the linears: the same function, one op fewer than a runtime multiply."""
    if isinstance(owner, nn.Linear):
        owner.weight.data = owner.weight / scale[:, None]
        if owner.bias is not None:
            owner.bias.data = owner.bias / scale
    else:
        owner.weight.data = owner.weight / scale
    for linear in linears:
        linear.weight.data = linear.weight * scale[None, :]


def layer_scale_owners(layer) -> list[tuple[nn.Module, list[nn.Linear]]]:
    """(op that makes the input, linears reading it) for every input of a decoder layer AWQ can scale without
    a new op. o_proj's input comes out of attention: its channels fold into v_proj only without grouped KV
    heads, so it is left."""
    linears = layer_linears(layer)
    return [(layer.input_layernorm, linears["attention_in"]),
            (layer.post_attention_layernorm, linears["mlp_in"]),
            (layer.mlp.up_proj, linears["mlp_out"])]


def _clear_cache(layer) -> None:
    layer.self_attn.k_cache.zero_()
    layer.self_attn.v_cache.zero_()


@torch.no_grad()
def search_layer(layer, states: list[torch.Tensor], arguments: list[tuple], weight_config) -> list[torch.Tensor]:
    """Searches and folds AWQ's scales for one float decoder layer, one AWQObserver per input shared by several
    linears (their weights concatenated: AWQ searches one scale per input), from `states`, the hidden states
    entering it (one per calibration window, each called with its `arguments`). Returns the states leaving it."""
    from torchao.prototype.awq.core import AWQObserver

    groups = layer_scale_owners(layer)
    observers = [AWQObserver(torch.cat([l.weight for l in linears]), None, weight_config, AWQ_SCALE_CANDIDATES)
                 for _owner, linears in groups]
    hooks = [linears[0].register_forward_pre_hook(lambda m, args, obs=obs: obs(args[0], None))
             for obs, (_owner, linears) in zip(observers, groups)]
    leaving = []
    try:
        for x, args in zip(states, arguments):
            _clear_cache(layer)
            leaving.append(layer(x, *args))
    finally:
        for hook in hooks:
            hook.remove()
        _clear_cache(layer)
    for (owner, linears), observer in zip(groups, observers):
        fold_input_scale(owner, linears, observer.calculate_qparams().to(torch.float32))
    return leaving


def _entering_first_layer(module, windows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple]]:
    """The hidden states entering the first decoder layer, and each window's layer arguments (one per window
    length: the windows all start at position 0)."""
    states = [module.model.embed_tokens(tokens) for tokens in windows]
    by_length: dict[int, tuple] = {}
    for tokens, x in zip(windows, states):
        if tokens.shape[1] not in by_length:
            by_length[tokens.shape[1]] = module.layer_arguments(tokens.shape[1], torch.tensor([0]), x.dtype)
    return states, [by_length[tokens.shape[1]] for tokens in windows]


@torch.no_grad()
def apply_awq(module, weight_config, windows: list[torch.Tensor]) -> None:
    """AWQ's scales folded into every decoder layer of a float module, from the calibration `windows`. The
    output layer (vocabulary-wide, its input the final norm's) is left to the scheme's qparams."""
    states, arguments = _entering_first_layer(module, windows)
    for layer in module.model.layers:
        states = search_layer(layer, states, arguments, weight_config)


class AwqAsBuilt:
    """apply_awq on a module models.llama.build_exportable is filling, called on each unit as it is filled and
    before it is quantized (transform_unit): the float embedding makes the calibration text's hidden states,
    and each float decoder layer has its scales searched and folded from the states entering it and passes on
    the states leaving it. Only one float decoder layer and the states are held: the scales are apply_awq's."""

    def __init__(self, weight_config, windows: list[torch.Tensor]):
        self.weight_config = weight_config
        self.windows = windows
        self.states: list[torch.Tensor] | None = None
        self.arguments: list[tuple] = []

    @torch.no_grad()
    def __call__(self, unit: nn.Module, module) -> None:
        if unit is module.model.embed_tokens:
            self.states, self.arguments = _entering_first_layer(module, self.windows)
        elif any(unit is layer for layer in module.model.layers):
            if self.states is None:
                raise ValueError("AWQ by unit needs the embedding filled before the first decoder layer")
            self.states = search_layer(unit, self.states, self.arguments, self.weight_config)
            if unit is module.model.layers[-1]:
                self.states = None  # the states leaving the last layer are no longer needed
