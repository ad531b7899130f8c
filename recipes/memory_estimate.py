"""Provisional memory estimate of one `run()` job: parameter count x bytes per parameter.

Provisional: a first-order model (fp32 state dict + exportable module + the lowered program and its
serialized bytes), fitted to one measurement (Llama-3.2-1B, xnnpack-8da4w, export only). A measured
per-stage estimate replaces it."""
from __future__ import annotations

from dataclasses import dataclass

GB = 1024**3
BASE_BYTES = 1 * GB  # interpreter, torch, executorch and transformers loaded
# bytes per parameter of the .pte by scheme (embeddings included); unknown schemes count as fp32
PTE_BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "8da8w": 1.05, "8da4w": 0.78, "8da4w-emb4": 0.62,
                       "int8-weight": 1.3, "int4-weight": 0.9, "qnn-16a4w": 0.9, "qnn-16a8w": 1.3, "qnn-8a8w": 1.3}
CHECKPOINT_BYTES_PER_PARAM = 4.0  # the loader upcasts every tensor to fp32
MODULE_BYTES_PER_PARAM = 2.0  # the exportable module's own copies during quantization and export
SMALL_JOB_BYTES = 3 * GB  # below this a job takes one core, so two run side by side


@dataclass(frozen=True)
class JobEstimate:
    memory_bytes: int
    num_cpus: int
    parameters: int
    basis: str


def parameter_count(config) -> int:
    """Parameters of a Llama config, tied embeddings counted once."""
    from models.llama import LlamaShape

    s = LlamaShape.from_config(config)
    attention = s.hidden * s.head_dim * (2 * s.n_heads + 2 * s.n_kv_heads)
    mlp = 3 * s.hidden * s.intermediate
    per_layer = attention + mlp + 2 * s.hidden
    embeddings = s.vocab_size * s.hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return s.n_layers * per_layer + embeddings + s.hidden


def estimate_job(config, recipes: list[str], max_seq_len: int, generate: bool) -> JobEstimate:
    """Peak bytes of one process lowering `recipes` of this model, and the cores it should take."""
    from recipes.registry import get_recipe

    params = parameter_count(config)
    pte = max(PTE_BYTES_PER_PARAM.get(get_recipe(name).quantization, 4.0) for name in recipes)
    per_param = CHECKPOINT_BYTES_PER_PARAM + MODULE_BYTES_PER_PARAM + 2 * pte
    if generate:
        per_param += CHECKPOINT_BYTES_PER_PARAM + pte  # the fp32 eager reference and the loaded .pte
    from models.llama import LlamaShape

    s = LlamaShape.from_config(config)
    kv_cache = 2 * s.n_layers * s.n_kv_heads * s.head_dim * max_seq_len * 4 * (2 if generate else 1)
    memory = int(BASE_BYTES + params * per_param + kv_cache)
    return JobEstimate(memory_bytes=memory, num_cpus=1 if memory < SMALL_JOB_BYTES else 2, parameters=params,
                       basis=f"provisional: {params / 1e9:.2f}B parameters x {per_param:.2f} bytes + 1 GB base")
