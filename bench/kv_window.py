"""What a ring cache's attention (the first tokens and a window of recent ones) costs the built-in model against
full attention at one context, on text that repeats and on text that does not: eager fp32 with aten SDPA, its mask
set to what the ring program attends (tests/test_kv_cache.py checks the ring program against this mask).

    python -m bench.kv_window [--context 2048] [--windows 512,1024]     (one JSON line)

The evaluation texts repeat after their length (817 tokens): full attention then copies the earlier occurrence,
which a window shorter than that cannot see; the calibration text's first tokens do not repeat."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.kv import running_text_ids
from recipes import thread_policy

if __name__ == "__main__":
    thread_policy.limit_openmp_default()


def score(context: int, windows: tuple[int, ...]) -> dict:
    import torch

    # load torch, which bench's driver leaves to the processes it starts
    from models.checkpoint import load_checkpoint
    from models.llama import ATTENTION_SINK_TOKENS, ExportOptions, build_exportable
    from quant.calibration import CALIBRATION_TEXT
    from recipes import fidelity

    checkpoint = load_checkpoint(None)
    tokenizer = checkpoint.tokenizer
    period = len(fidelity.eval_token_ids(tokenizer)) + len(fidelity.eval_token_ids(tokenizer, fidelity.HELDOUT_TEXT))
    texts = {f"evaluation texts, repeated every {period} tokens": running_text_ids(tokenizer, context),
             "calibration text, no repeat": tokenizer(Path(CALIBRATION_TEXT).read_text(),
                                                      add_special_tokens=False)["input_ids"][:context]}
    module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa"))
    query, key = torch.arange(context)[:, None], torch.arange(context)[None, :]
    causal = key <= query
    rows = []
    for text, ids in texts.items():
        targets = torch.tensor(ids[1:])
        logits = {}
        for window in (None, *windows):
            sinks_and_window = (key < ATTENTION_SINK_TOKENS) | (key > query - window) if window else True
            module.causal_mask.copy_(causal & sinks_and_window)
            with torch.no_grad():
                logits[window] = module(torch.tensor([ids]), torch.tensor([0]))[0, :-1].float()
        late = context // 2  # the positions whose window leaves out the most
        for window in windows:
            rows.append({"text": text, "context": context, "window": window, "sinks": ATTENTION_SINK_TOKENS,
                         "all": fidelity.compare(logits[None], logits[window], targets),
                         f"from {late}": fidelity.compare(logits[None][late:], logits[window][late:],
                                                          targets[late:])})
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_window")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--windows", default="512,1024")
    args = parser.parse_args()
    started = time.perf_counter()
    result = score(args.context, tuple(int(w) for w in args.windows.split(",")))
    print(json.dumps({**result, "seconds": round(time.perf_counter() - started, 1)}), flush=True)


if __name__ == "__main__":
    main()
