"""Granite 3: multipliers on the embedding, the residual branches and the attention scores, and the logits divided
by logits_scaling, all folded into the weights at load (the module and every backend see a Llama)."""
import math

from models.families import Family, register


def _folds(config) -> dict[str, float]:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    residual = float(config.residual_multiplier)
    # SDPA scales scores by 1/sqrt(head_dim); the family scales them by attention_multiplier instead
    query = float(config.attention_multiplier) * math.sqrt(head_dim)
    return {"model.embed_tokens.weight": float(config.embedding_multiplier),
            "self_attn.o_proj.weight": residual, "self_attn.o_proj.bias": residual,
            "mlp.down_proj.weight": residual, "mlp.down_proj.bias": residual,
            "self_attn.q_proj.weight": query, "self_attn.q_proj.bias": query,
            "lm_head.weight": 1.0 / float(config.logits_scaling)}


FAMILY = register(Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    rotary="transformers.models.granite.modeling_granite.GraniteRotaryEmbedding",
    folds=_folds,
    example_repos=("ibm-granite/granite-3.3-2b-instruct", "ibm-granite/granite-3.3-8b-instruct"),
))
