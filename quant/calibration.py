"""Calibration inputs. PT2E quantizers take a few built-in prompts, tokenized with the model's own tokenizer
and chat template, as (tokens[1, T], input_pos[1]) prefill calls. Calibrated weight algorithms (AWQ, GPTQ) and
the mixed-precision search read quant/calibration_text.txt, a text no evaluation text shares a passage with. A user's
calibration file (quant/calibration_file.py), once tokenized, replaces both: the text's windows and the prompts."""
from __future__ import annotations

from pathlib import Path

import torch

from models.prompting import prompt_token_ids
from quant.calibration_file import CalibrationFile

CALIBRATION_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
)

CALIBRATION_TEXT = Path(__file__).resolve().parent / "calibration_text.txt"
CALIBRATION_TEXT_SOURCE = ("The Declaration of Independence (United States, 1776), full text, then Lewis Carroll, "
                           "Alice's Adventures in Wonderland (1865), chapters I-XII (Project Gutenberg eBook #11); "
                           "public domain")
# The tokens AWQ's per-input scale search and the mixed-precision search read (GPTQ reads more: its
# calibration_tokens in quant/algorithms.py): enough for their searches, few enough that they stay a small part
# of quantizing.
CALIBRATION_TOKENS = 512


def calibration_inputs(tokenizer, max_seq_len: int, prompts=CALIBRATION_PROMPTS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs = []
    for prompt in prompts:
        ids = prompt_token_ids(tokenizer, prompt)[: max_seq_len - 1]
        inputs.append((torch.tensor([ids], dtype=torch.long), torch.tensor([0], dtype=torch.long)))
    return inputs


def file_calibration_inputs(file: CalibrationFile, call_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A calibration file's first CALIBRATION_TOKENS tokens as PT2E prefill calls from position 0, each of at
    most call_tokens (the program's token dimension), in place of the built-in prompts."""
    return [(window, torch.tensor([0], dtype=torch.long))
            for window in _windows(list(file.ids[:CALIBRATION_TOKENS]), call_tokens)]


def calibration_windows(tokenizer, max_seq_len: int, max_tokens: int | None = CALIBRATION_TOKENS,
                        file: CalibrationFile | None = None) -> list[torch.Tensor]:
    """The calibration text's first `max_tokens` tokens (None: all) as windows [1, T] of at most max_seq_len,
    each run from position 0; the tokenized calibration file's instead when one is given."""
    if file is not None:
        return _windows(list(file.ids[:max_tokens]), max_seq_len)
    ids = list(tokenizer(CALIBRATION_TEXT.read_text(), add_special_tokens=False)["input_ids"])[:max_tokens]
    return _windows(ids, max_seq_len)


def _windows(ids: list[int], length: int) -> list[torch.Tensor]:
    return [torch.tensor([ids[i:i + length]], dtype=torch.long) for i in range(0, len(ids), length)
            if len(ids[i:i + length]) > 1]


def describe_calibration(windows: list[torch.Tensor], searched: list[torch.Tensor] | None = None,
                         search_products: str | None = None, file: CalibrationFile | None = None) -> dict:
    """tokens: what the algorithm read (GPTQ's Hessians, or AWQ's search); search_tokens: what AWQ's search and
    the mixed-precision search read, when fewer; search_products: the dtype AWQ's search multiplied in. With a
    calibration file: its name (never its path), all its tokens and the SHA-256 of its bytes."""
    text = file.describe if file is not None else f"quant/{CALIBRATION_TEXT.name} ({CALIBRATION_TEXT_SOURCE})"
    described = {"text": text, "tokens": sum(w.shape[1] for w in windows)}
    if searched is not None and searched is not windows:
        described["search_tokens"] = sum(w.shape[1] for w in searched)
    if search_products is not None:
        described["search_products"] = search_products
    if file is not None:
        described.update(file=file.name, file_tokens=len(file.ids), file_sha256=file.sha256)
    return described
