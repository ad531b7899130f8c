"""Llama itself (Llama 2/3, SmolLM2, TinyLlama): the module as it is, the checkpoint's names as they are."""
from models.families import Family, register

FAMILY = register(Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    gguf_architecture="llama",
    example_repos=("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct",
                   "meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct"),
))
