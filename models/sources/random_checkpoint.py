"""A shape-identical random checkpoint: a Hugging Face folder with a published config.json, random bf16
weights of exactly its shapes, and a byte-level BPE tokenizer with exactly the model's vocabulary size.
Delegation, .pte size, export time, peak memory and decode speed do not depend on the weights' values, so
this stands in where the Hub is not reachable; anything about output quality needs the real weights."""
from __future__ import annotations

import json
import math
import shutil
from itertools import chain, product
from pathlib import Path

# Letters and the space first, so that even a small vocabulary spells ordinary prompts.
_ASCII_ORDER = [*range(97, 123), 32, *range(65, 91), *range(48, 58), *range(33, 48), *range(58, 65),
                *range(91, 97), *range(123, 127), 10, 9, *range(0, 9), *range(11, 32), 127]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def _byte_symbols() -> dict[int, str]:
    """The byte-level pre-tokenizer's alphabet (GPT-2's): each byte as one printable character."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    symbols, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def shape_tokenizer(config: dict):
    """A byte-level BPE tokenizer (the kind ExecuTorch's LLM runner loads, like Llama 3's and SmolLM2's) with
    one id for every row of the model's embedding: the config's BOS and EOS ids are special tokens, an
    <unk> takes the highest free id, and every other id is an ASCII string of one to three characters
    (merged pairwise, so BPE rebuilds them). Whatever id a random model emits decodes to whole UTF-8 text,
    which the runner's token callback needs; a character outside ASCII encodes as <unk>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    eos_ids = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int) and 0 <= i < vocab_size]
    bos_id = config.get("bos_token_id")
    specials = {}
    if isinstance(bos_id, int) and 0 <= bos_id < vocab_size:
        specials[bos_id] = "<s>"
    for k, i in enumerate(eos_ids):
        specials.setdefault(i, "</s>" if k == 0 else f"<|eos_{k}|>")
    specials[next(i for i in reversed(range(vocab_size)) if i not in specials)] = "<unk>"
    free_ids = (i for i in range(vocab_size) if i not in specials)
    symbols = _byte_symbols()
    chars = [symbols[b] for b in _ASCII_ORDER]
    strings = chain.from_iterable(product(chars, repeat=length) for length in (1, 2, 3))
    vocab, merges = {name: i for i, name in specials.items()}, []
    for token_id, parts in zip(free_ids, strings):  # stops once every id has its token
        vocab["".join(parts)] = token_id
        if len(parts) > 1:
            merges.append(("".join(parts[:-1]), parts[-1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials.values()])
    # the pad token named too, so a family's own tokenizer class adds no default one of its own past the vocabulary
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>",
                                        bos_token=specials.get(bos_id), eos_token=specials[eos_ids[0]] if eos_ids else None)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# As the Hub ships big models: bf16 safetensors shards of at most this many bytes, named by an index.
SHARD_BYTES = 2 * 10**9


def _shards(shapes: dict, bytes_per_value: int = 2) -> list[dict]:
    """The tensors' names and shapes, in order, cut into shards of at most SHARD_BYTES (a bigger tensor alone)."""
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        nbytes = bytes_per_value * math.prod(shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    return [*shards, current]


def is_written(folder: Path) -> bool:
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


def checkpoint_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors a published checkpoint with this config.json holds, and their shapes: named by the family's own
    transformers model (a tied output layer is not stored)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_config = AutoConfig.for_model(config.get("model_type", "llama"),
                                        **{k: v for k, v in config.items() if k != "model_type"})
    with torch.device("meta"):  # shapes only: no memory for a model built just to name its tensors
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(model_config).state_dict().items()}
    if model_config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def write_random_checkpoint(config: dict, folder: Path, seed: int = 0) -> Path:
    """Writes the folder once (atomically: built beside it, then renamed); returns it. One shard is in memory
    at a time, so an 8B checkpoint needs about a shard's bytes, not the model's."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    if is_written(folder):
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    shapes = checkpoint_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))
    shards = _shards(shapes)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = (torch.randn(shape, generator=generator) * std).to(torch.bfloat16)
            weight_map[name] = file
            total += 2 * math.prod(shape)
        save_file(tensors, partial / file, metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        (partial / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    shape_tokenizer(config).save_pretrained(partial)
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
