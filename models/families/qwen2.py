"""Qwen2 and Qwen2.5: a bias on q, k and v, none on o_proj."""
from models.families import Family, register

FAMILY = register(Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    gguf_architecture="qwen2",
    rotary="transformers.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding",
    differences=lambda config: {"qkv_bias": True, "attention_bias": False},
    example_repos=("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"),
))
