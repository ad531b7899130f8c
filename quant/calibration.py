"""Calibration inputs for PT2E quantizers: a few built-in prompts, tokenized with the model's own
tokenizer and chat template, as (tokens[1, T], input_pos[1]) prefill calls."""
from __future__ import annotations

import torch

from models.prompting import prompt_token_ids

CALIBRATION_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
)


def calibration_inputs(tokenizer, max_seq_len: int, prompts=CALIBRATION_PROMPTS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs = []
    for prompt in prompts:
        ids = prompt_token_ids(tokenizer, prompt)[: max_seq_len - 1]
        inputs.append((torch.tensor([ids], dtype=torch.long), torch.tensor([0], dtype=torch.long)))
    return inputs
