"""A shape-identical random checkpoint: a Hugging Face folder with a published config.json, random bf16
weights of exactly its shapes, and a small word-level tokenizer. Delegation, .pte size, export time, peak
memory and decode speed do not depend on the weights' values, so this stands in where the Hub is not
reachable; anything about output quality needs the real weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

WORDS = "the capital of France is Paris . what is hello world , how are you ?".split()


def small_tokenizer():
    """Word-level, a few dozen ids: valid for any vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def write_random_checkpoint(config: dict, folder: Path, seed: int = 0) -> Path:
    """Writes the folder once (atomically: built beside it, then renamed); returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    llama_config = LlamaConfig(**config)
    with torch.device("meta"):  # shapes only: no memory for a model built just to name its tensors
        shapes = {k: v.shape for k, v in LlamaForCausalLM(llama_config).state_dict().items()}
    if llama_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    generator = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    del tensors
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    small_tokenizer().save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
