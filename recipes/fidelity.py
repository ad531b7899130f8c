"""How far a recipe's model is from fp32: on the shipped evaluation text (quant/eval_text.txt, the opening
of Jane Austen's Pride and Prejudice, 1813, public domain), perplexity of the fp32 eager reference and
of the recipe's model, top-1 next-token agreement with fp32, and mean KL(fp32 || recipe); the same figures
on a held-out second text (quant/eval_text_heldout.txt), so tuning on the first shows up on the second.
Logits come from the same step functions as generation (recipes/generate.py): the text is prefilled in
windows of at most max_seq_len tokens, each from position 0, and the program returns every position's logits."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

EVAL_TEXT = Path(__file__).resolve().parent.parent / "quant" / "eval_text.txt"
EVAL_TEXT_SOURCE = "Jane Austen, Pride and Prejudice (1813), chapter 1 opening; public domain"
HELDOUT_TEXT = EVAL_TEXT.with_name("eval_text_heldout.txt")
HELDOUT_TEXT_SOURCE = "Charles Dickens, A Tale of Two Cities (1859), book 1 chapter 1 opening; public domain"

# scheme -> (what it must reach, test on the fidelity figures); schemes without one report meets_target None
TARGETS: dict[str, tuple[str, Callable[[dict], bool]]] = {
    "fp32": ("top-1 agreement with fp32 eager = 100 %", lambda f: f["top1_agreement_percent"] == 100.0),
    "8da4w": ("perplexity <= 1.10 x fp32 eager", lambda f: f["perplexity_ratio"] <= 1.10),
}


def eval_token_ids(tokenizer, path: Path = EVAL_TEXT) -> list[int]:
    return list(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])


def sequence_logits(step: Callable, ids: list[int], max_seq_len: int) -> torch.Tensor:
    """logits[N, vocab] (fp32) predicting ids[1:] of every window; windows never cross, so each
    position is conditioned only on its own window's earlier tokens, the same for every engine."""
    predictions = []
    for start in range(0, len(ids), max_seq_len):
        window = ids[start:start + max_seq_len]
        if len(window) < 2:
            break
        logits = step(torch.tensor([window], dtype=torch.long), torch.tensor([0], dtype=torch.long))
        # a copy: the runtime's step lends its output buffer, which the next window overwrites
        predictions.append(logits[0, :-1].to(torch.float32, copy=True))
    return torch.cat(predictions)


def targets_of(ids: list[int], max_seq_len: int) -> torch.Tensor:
    """The next tokens sequence_logits predicts, in the same order."""
    targets = []
    for start in range(0, len(ids), max_seq_len):
        window = ids[start:start + max_seq_len]
        if len(window) < 2:
            break
        targets.extend(window[1:])
    return torch.tensor(targets, dtype=torch.long)


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, rows: int = 32) -> dict:
    """The fidelity figures of `logits` against fp32 `reference` (both [N, vocab]) on next tokens `targets`.
    Float64, a few rows at a time: the whole [N, vocab] in float64 with its temporaries is over 1 GB."""
    nll_ref = nll = kl = 0.0
    for start in range(0, len(targets), rows):
        ref_logp = torch.log_softmax(reference[start:start + rows].double(), dim=-1)
        logp = torch.log_softmax(logits[start:start + rows].double(), dim=-1)
        chunk_targets = targets[start:start + rows, None]
        nll_ref -= ref_logp.gather(1, chunk_targets).sum().item()
        nll -= logp.gather(1, chunk_targets).sum().item()
        kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
    count = len(targets)
    ppl_ref, ppl = math.exp(nll_ref / count), math.exp(nll / count)
    agreement = (reference.argmax(-1) == logits.argmax(-1)).double().mean().item() * 100
    return {
        "perplexity_fp32": round(ppl_ref, 4),
        "perplexity": round(ppl, 4),
        "perplexity_ratio": round(ppl / ppl_ref, 4),
        "top1_agreement_percent": round(agreement, 2),
        "mean_kl": round(max(kl / count, 0.0), 6),
    }


def fidelity_report(engine: str, scheme: str, reference: torch.Tensor, logits: torch.Tensor,
                    targets: torch.Tensor) -> dict:
    figures = compare(reference, logits, targets)
    target = TARGETS.get(scheme)
    return {
        "engine": engine,
        "text": f"quant/eval_text.txt ({EVAL_TEXT_SOURCE})",
        "positions": len(targets),
        **figures,
        "target": target[0] if target else None,
        "meets_target": bool(target[1](figures)) if target else None,
    }


def heldout_report(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    return {"text": f"quant/{HELDOUT_TEXT.name} ({HELDOUT_TEXT_SOURCE})", "positions": len(targets),
            **compare(reference, logits, targets)}
