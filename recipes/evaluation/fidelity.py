"""How far a recipe's model is from fp32: on the shipped evaluation text (quant/eval_text.txt, the opening
of Jane Austen's Pride and Prejudice, 1813, public domain), perplexity of the fp32 eager reference and
of the recipe's model, top-1 next-token agreement with fp32, and mean KL(fp32 || recipe); the same figures
on a held-out second text (quant/eval_text_heldout.txt), so tuning on the first shows up on the second; and, with
a long enough calibration file of the user's, on its end that calibration did not read.
Logits come from the same step functions as generation (recipes/running/generate.py): the text is prefilled in
windows of at most max_seq_len tokens, each from position 0, and the program returns every position's logits."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

from recipes.output.report import Fidelity, Heldout

EVAL_TEXT = Path(__file__).resolve().parents[2] / "quant" / "eval_text.txt"
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


def window_logits(step: Callable, ids: list[int], max_seq_len: int) -> Iterator[torch.Tensor]:
    """Each window's logits [T - 1, vocab] (fp32) predicting its ids[1:]; windows never cross, so each position
    is conditioned only on its own window's earlier tokens, the same for every engine. A yielded tensor may be
    the runtime's output buffer, which the next window overwrites: use it before asking for the next."""
    for start in range(0, len(ids), max_seq_len):
        window = ids[start:start + max_seq_len]
        if len(window) < 2:
            break
        logits = step(torch.tensor([window], dtype=torch.long), torch.tensor([0], dtype=torch.long))
        yield logits[0, :-1].to(torch.float32)


def sequence_logits(step: Callable, ids: list[int], max_seq_len: int) -> torch.Tensor:
    """logits[N, vocab] (fp32) of every window (window_logits), predicting targets_of(ids), copied into one
    tensor as they come: a text's logits are held once, never as pieces beside their concatenation."""
    positions = len(targets_of(ids, max_seq_len))
    logits = None
    row = 0
    for window in window_logits(step, ids, max_seq_len):
        if logits is None:
            logits = torch.empty(positions, window.shape[-1], dtype=torch.float32)
        logits[row:row + len(window)] = window
        row += len(window)
    if logits is None:
        raise ValueError("a text of fewer than two tokens has no next token to predict")
    return logits


def targets_of(ids: list[int], max_seq_len: int) -> torch.Tensor:
    """The next tokens sequence_logits predicts, in the same order."""
    targets = []
    for start in range(0, len(ids), max_seq_len):
        window = ids[start:start + max_seq_len]
        if len(window) < 2:
            break
        targets.extend(window[1:])
    return torch.tensor(targets, dtype=torch.long)


class _Distance:
    """Sums of the fidelity figures over rows of logits, taken a few rows at a time in float64: a whole text's
    [N, vocab] in float64 with its temporaries is over 1 GB."""

    def __init__(self):
        self.nll_ref = self.nll = self.kl = 0.0
        self.agreeing = self.count = 0

    def add(self, reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, rows: int = 32) -> None:
        for start in range(0, len(targets), rows):
            ref_rows, recipe_rows = reference[start:start + rows], logits[start:start + rows]
            self.agreeing += int((ref_rows.argmax(-1) == recipe_rows.argmax(-1)).sum())
            ref_logp = torch.log_softmax(ref_rows.double(), dim=-1)
            logp = torch.log_softmax(recipe_rows.double(), dim=-1)
            chunk_targets = targets[start:start + rows, None]
            self.nll_ref -= ref_logp.gather(1, chunk_targets).sum().item()
            self.nll -= logp.gather(1, chunk_targets).sum().item()
            self.kl += (ref_logp.exp() * (ref_logp - logp)).sum().item()
        self.count += len(targets)

    def figures(self) -> dict:
        ppl_ref, ppl = math.exp(self.nll_ref / self.count), math.exp(self.nll / self.count)
        return {
            "perplexity_fp32": round(ppl_ref, 4),
            "perplexity": round(ppl, 4),
            "perplexity_ratio": round(ppl / ppl_ref, 4),
            "top1_agreement_percent": round(self.agreeing / self.count * 100, 2),
            "mean_kl": round(max(self.kl / self.count, 0.0), 6),
        }


def compare(reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """The fidelity figures of `logits` against fp32 `reference` (both [N, vocab]) on next tokens `targets`."""
    distance = _Distance()
    distance.add(reference, logits, targets)
    return distance.figures()


def compare_step(step: Callable, ids: list[int], max_seq_len: int, reference: torch.Tensor,
                 targets: torch.Tensor) -> dict:
    """compare() of `step`'s logits on `ids` against `reference` (sequence_logits of the fp32 model), one window
    at a time: the recipe's logits for the whole text, a vocabulary-wide row per token, are never all held."""
    distance = _Distance()
    row = 0
    for window in window_logits(step, ids, max_seq_len):
        distance.add(reference[row:row + len(window)], window, targets[row:row + len(window)])
        row += len(window)
    return distance.figures()


def fidelity_report(engine: str, scheme: str, figures: dict, positions: int) -> Fidelity:
    target = TARGETS.get(scheme)
    return Fidelity(engine=engine, text=f"quant/eval_text.txt ({EVAL_TEXT_SOURCE})", positions=positions, **figures,
                    target=target[0] if target else None,
                    meets_target=bool(target[1](figures)) if target else None)


def heldout_report(figures: dict, positions: int) -> Heldout:
    return Heldout(text=f"quant/{HELDOUT_TEXT.name} ({HELDOUT_TEXT_SOURCE})", positions=positions, **figures)


@dataclass
class ScoredText:
    """A text as the reference scored it: its token ids, the reference's logits and the next tokens they predict."""
    ids: list[int]
    logits: torch.Tensor
    targets: torch.Tensor


def score_text(step: Callable, ids: list[int], max_seq_len: int) -> ScoredText:
    return ScoredText(ids, sequence_logits(step, ids, max_seq_len), targets_of(ids, max_seq_len))


@dataclass
class EvalReference:
    """What a job's recipes are measured against: the reference engine's scores on both texts and, for the layer
    map, each decoder layer's output on the evaluation text; with a calibration file, its held-out slice's scores
    and what the report calls it."""
    engine: str
    eval: ScoredText
    heldout: ScoredText
    layers: list[torch.Tensor] | None = None
    calibration_heldout: ScoredText | None = None
    calibration_heldout_text: str | None = None


def recipe_fidelity(step: Callable, engine: str, scheme: str, max_seq_len: int, reference: EvalReference) -> Fidelity:
    """The fidelity section of a recipe whose model `step` runs on `engine`, without its layer map."""
    scored = reference.eval
    found = fidelity_report(engine, scheme, compare_step(step, scored.ids, max_seq_len, scored.logits, scored.targets),
                            len(scored.targets))
    heldout = reference.heldout
    found.heldout = heldout_report(
        compare_step(step, heldout.ids, max_seq_len, heldout.logits, heldout.targets), len(heldout.targets))
    found.reference_engine = reference.engine
    if reference.calibration_heldout is not None:
        scored = reference.calibration_heldout
        found.calibration_heldout = Heldout(
            text=reference.calibration_heldout_text, positions=len(scored.targets),
            **compare_step(step, scored.ids, max_seq_len, scored.logits, scored.targets))
    return found
