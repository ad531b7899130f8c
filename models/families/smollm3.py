"""SmolLM3: some layers apply no rope (no_rope_layers, 1 where a layer does)."""
from models.families import Family, register

FAMILY = register(Family(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    rotary="transformers.models.smollm3.modeling_smollm3.SmolLM3RotaryEmbedding",
    differences=lambda config: {"rope_layers": tuple(bool(uses) for uses in config.no_rope_layers)},
    example_repos=("HuggingFaceTB/SmolLM3-3B",),
))
