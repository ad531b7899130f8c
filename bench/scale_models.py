"""Random checkpoints with the exact shapes of the models people ship, as the Hub ships them: bf16
safetensors shards (models/sources/random_checkpoint.py) + model.safetensors.index.json + config.json + a tokenizer.

    python -m bench.scale_models NAME DEST

The config values are copied from each model's config.json on the Hugging Face Hub (meta-llama/
Llama-3.2-1B-Instruct, meta-llama/Llama-3.2-3B-Instruct, meta-llama/Llama-3.1-8B-Instruct,
TinyLlama/TinyLlama-1.1B-Chat-v1.0; Qwen/Qwen3-1.7B through zoo/models/). Random weights
time exactly as real ones here: every program Lowerbench and optimum make is the same sequence of kernels
whatever the weights hold (no data-dependent control flow: no early exit, no sparsity, no expert routing),
and greedy decoding runs a fixed number of steps because end of sequence is ignored.

The tokenizer is models/sources/random_checkpoint.py's byte-level BPE with exactly the model's vocabulary size
(the real tokenizers cannot be downloaded here): every id it makes is in range, every id the model emits
decodes to text, and ExecuTorch's LLM runner loads it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

_LLAMA_3_2_COMMON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}

CONFIGS = {
    "llama-3.2-1b": {**_LLAMA_3_2_COMMON, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192,
                     "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8},
    "llama-3.2-3b": {**_LLAMA_3_2_COMMON, "head_dim": 128, "hidden_size": 3072, "intermediate_size": 8192,
                     "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8},
    "llama-3.1-8b": {
        **_LLAMA_3_2_COMMON, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "tinyllama-1.1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 2048, "num_attention_heads": 32,
        "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 32000,
    },
    # a Llama-like family beside Llama-3.2-1B, from the zoo's copy of its published config
    "qwen3-1.7b": json.loads((Path(__file__).resolve().parent.parent / "zoo" / "models" / "qwen3-1.7b.json")
                             .read_text())["config"],
}


def parameter_count(config: dict) -> int:
    from math import prod

    from models.sources.random_checkpoint import checkpoint_shapes  # loads torch, which bench's driver leaves to
    # the processes it starts

    return sum(prod(shape) for shape in checkpoint_shapes(config).values())


def make_checkpoint(name: str, dest: Path, seed: int = 0) -> Path:
    """Writes the checkpoint once (a written folder is reused): models/sources/random_checkpoint.py, shard by shard."""
    from models.sources.random_checkpoint import write_random_checkpoint  # loads torch, which bench's driver leaves to
    # the processes it starts

    return write_random_checkpoint(CONFIGS[name], Path(dest), seed)


if __name__ == "__main__":
    print(json.dumps({"folder": str(make_checkpoint(sys.argv[1], Path(sys.argv[2])))}))
