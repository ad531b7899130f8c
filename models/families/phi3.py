"""Phi-3 and Phi-4-mini: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj, split by rows on load), rope on
the leading partial_rotary_factor of each head, and longrope scaling, whose cos/sin transformers' own Phi-3 rotary
embedding computes; within original_max_position_embeddings it uses the short factors, the only ones a
fixed table can hold, so that is the context."""
from models.families import Family, register


def _differences(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    differences = {"rotary_dim": int(head_dim * factor)}
    if rope.get("rope_type") == "longrope" and rope.get("original_max_position_embeddings"):
        differences["max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return differences


FAMILY = register(Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_architecture="phi3",
    rotary="transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding",
    differences=_differences,
    fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
    example_repos=("microsoft/Phi-4-mini-instruct", "microsoft/Phi-3.5-mini-instruct"),
))
