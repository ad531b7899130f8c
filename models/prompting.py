"""Turning a user prompt into token ids with the model's own tokenizer and chat template."""
from __future__ import annotations


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """Chat models get their chat template; plain models get the raw prompt."""
    if getattr(tokenizer, "chat_template", None):
        return chat_token_ids(tokenizer, [{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """A chat ([{role, content}, ...]) through the tokenizer's own chat template."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def stop_token_ids(tokenizer, eos_token_ids=()) -> set[int]:
    """The checkpoint's eos ids (models.sources.checkpoint.Checkpoint.eos_token_ids) plus the tokenizer's own."""
    ids = set(eos_token_ids)
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return ids


def prompt_text(tokenizer, prompt: str) -> str:
    """The text whose tokens, without any special tokens added, are prompt_token_ids: what a runner that
    takes raw text (ExecuTorch's TextLLMRunner, num_bos=0) must be given."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    ids, bare = tokenizer.encode(prompt), tokenizer.encode(prompt, add_special_tokens=False)
    # A plain model whose tokenizer adds BOS (Llama 2, TinyLlama): the BOS goes in as its text.
    added = ids[: len(ids) - len(bare)] if ids[len(ids) - len(bare):] == bare else []
    return "".join(tokenizer.convert_ids_to_tokens(added)) + prompt
