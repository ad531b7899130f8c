"""Random checkpoints with the exact shapes of the models people ship, as the Hub ships them: bf16
safetensors shards (at most 2 GB each) + model.safetensors.index.json + config.json + a tokenizer.

    python -m bench.scale_models NAME DEST

The config values are copied from each model's config.json on the Hugging Face Hub (meta-llama/
Llama-3.2-1B-Instruct, meta-llama/Llama-3.2-3B-Instruct, meta-llama/Llama-3.1-8B-Instruct,
TinyLlama/TinyLlama-1.1B-Chat-v1.0). Random weights
time exactly as real ones here: every program Lowerbench and optimum make is the same sequence of kernels
whatever the weights hold (no data-dependent control flow: no early exit, no sparsity, no expert routing),
and greedy decoding runs a fixed number of steps because end of sequence is ignored.

The tokenizer is models/random_checkpoint.py's byte-level BPE with exactly the model's vocabulary size
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
}
SHARD_BYTES = 2 * 10**9


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face LlamaForCausalLM's parameter names and shapes for `config`."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def parameter_count(config: dict) -> int:
    from math import prod

    return sum(prod(shape) for shape in tensor_shapes(config).values())


def make_checkpoint(name: str, dest: Path, seed: int = 0) -> Path:
    """Writes the checkpoint once (a folder with config.json and its shards is reused)."""
    import torch
    from safetensors.torch import save_file

    # loads torch, which bench's driver leaves to the processes it starts
    from models.random_checkpoint import shape_tokenizer

    dest = Path(dest)
    if (dest / "config.json").is_file() and (dest / "model.safetensors.index.json").is_file():
        return dest
    config = CONFIGS[name]
    tmp = dest.with_name(dest.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    shapes = tensor_shapes(config)
    shards, current, size = [], {}, 0
    for tensor_name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[tensor_name] = shape
        size += nbytes
    shards.append(current)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for tensor_name, shape in shard.items():
            if tensor_name.endswith("norm.weight"):
                tensors[tensor_name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                std = config["initializer_range"]
                tensors[tensor_name] = (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
            weight_map[tensor_name] = file
            total += tensors[tensor_name].numel() * 2
        save_file(tensors, tmp / file, metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shape_tokenizer(config).save_pretrained(tmp)
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    print(json.dumps({"folder": str(make_checkpoint(sys.argv[1], Path(sys.argv[2])))}))
