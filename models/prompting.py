"""Turning a user prompt into token ids with the model's own tokenizer and chat template."""
from __future__ import annotations


def prompt_token_ids(tokenizer, prompt: str) -> list[int]:
    """Chat models get their chat template; plain models get the raw prompt."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(prompt)


def stop_token_ids(tokenizer, generation_config=None) -> set[int]:
    ids = set()
    for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids
