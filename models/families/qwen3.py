"""Qwen3 (dense): an RMSNorm over each head of q and of k before rope."""
from models.families import Family, register

FAMILY = register(Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf_architecture="qwen3",
    rotary="transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
    differences=lambda config: {"qk_norm": True},
    example_repos=("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"),
))
