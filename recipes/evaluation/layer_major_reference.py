"""The fp32 reference's logits on the fidelity texts for a model whose fp32 weights do not fit in memory: scored
layer-major. The module is filled from the checkpoint one unit at a time (embedding, each decoder layer, norm,
output layer: models.llama.build_exportable), and every token of every text goes through a unit before the unit
is dropped and the next one read, so one unit's fp32 weights are held at a time, beside the texts' hidden states.
Each window runs from position 0 with a fresh cache, exactly as the ordinary reference runs it (recipes/evaluation/fidelity.py),
so the logits are the same computation, reordered."""
from __future__ import annotations

import torch

from models.llama import DecoderLayer, ExportOptions, build_exportable
from recipes.evaluation.fidelity import ScoredText, targets_of


def _windows(ids: list[int], max_seq_len: int) -> list[list[int]]:
    """The windows recipes.evaluation.fidelity.window_logits runs, in its order."""
    windows = []
    for start in range(0, len(ids), max_seq_len):
        window = ids[start:start + max_seq_len]
        if len(window) < 2:
            break
        windows.append(window)
    return windows


def layer_major_scores(config, weights, texts: list[list[int]], max_seq_len: int) -> list[ScoredText]:
    """For each text (token ids), the fp32 reference's ScoredText, computed unit by unit."""
    windows = [_windows(ids, max_seq_len) for ids in texts]
    flat = [window for text_windows in windows for window in text_windows]
    if any(not text_windows for text_windows in windows):
        raise ValueError("a text of fewer than two tokens has no next token to predict")
    hidden: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    start = torch.zeros((1,), dtype=torch.long)

    def through(unit, module) -> None:
        nonlocal hidden
        with torch.no_grad():
            if unit is module.model.embed_tokens:
                hidden = [unit(torch.tensor([window], dtype=torch.long)) for window in flat]
            elif isinstance(unit, DecoderLayer):
                for i, state in enumerate(hidden):
                    unit.self_attn.k_cache.zero_()
                    unit.self_attn.v_cache.zero_()
                    hidden[i] = unit(state, *module.layer_arguments(state.shape[1], start, state.dtype))
            elif unit is module.model.norm:
                hidden = [unit(state) for state in hidden]
            elif unit is module.lm_head:
                rows = 0
                for text_windows in windows:
                    positions = sum(len(w) - 1 for w in text_windows)
                    text_logits = torch.empty(positions, module.shape.vocab_size, dtype=torch.float32)
                    row = 0
                    for _ in text_windows:
                        state = hidden[rows]
                        hidden[rows] = None
                        out = unit(state)[0, :-1].to(torch.float32)
                        text_logits[row:row + len(out)] = out
                        row += len(out)
                        rows += 1
                    logits.append(text_logits)
        unit.to("meta")  # its weights (and a layer's caches) are done with

    build_exportable(config, weights, ExportOptions(max_seq_len, attention="sdpa", dtype=torch.float32),
                     transform_unit=through)
    return [ScoredText(ids, text_logits, targets_of(ids, max_seq_len)) for ids, text_logits in zip(texts, logits)]
