"""Mistral and Ministral: Llama's layers under a sliding attention window (config.sliding_window), which the shared
shape reads; contexts within the window are plain causal attention."""
from models.families import Family, register

FAMILY = register(Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    gguf_architecture="mistral",
    rotary="transformers.models.mistral.modeling_mistral.MistralRotaryEmbedding",
    example_repos=("mistralai/Ministral-8B-Instruct-2410", "mistralai/Mistral-7B-Instruct-v0.3"),
))
