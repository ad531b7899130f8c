"""How far each KV cache dtype takes the built-in model from its fp32 cache, at long contexts, on the runtime:
recipes/fidelity.py's figures (perplexity ratio, top-1 agreement, mean KL) of each program against the program
with the same weights and an fp32 cache, and (fp32_model_*) against the fp32 weights' program with an fp32 cache.

    python -m bench.kv_fidelity [--contexts 512,2048]     (one JSON line; `python -m bench --phases kv-fidelity`)

The text is the evaluation texts (quant/eval_text.txt, then quant/eval_text_heldout.txt) chained and repeated to
the context's length, scored as one window from position 0: the program takes it in calls of its
get_max_seq_len, chained through its cache, so the last tokens attend over the whole context. One program per
(weights, cache) is exported at the longest context and scores every context on the first tokens of the text.
Weights whose qparams need no calibration (fp32, and 8da4w with HQQ qparams) are the same for every cache, so
the figures are the cache's alone."""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.kv import running_text_ids
from recipes import thread_policy

if __name__ == "__main__":
    thread_policy.limit_openmp_default()

WEIGHTS = {"xnnpack-fp32": {}, "xnnpack-8da4w": {"quant_algorithm": "hqq"}}
CACHES = {"fp32": {"kv_cache": "fp32"}, "fp16": {"kv_cache": "fp16"}, "int8": {"kv_cache": "int8"},
          "int8, window 512": {"kv_cache": "int8", "kv_cache_window": 512}}
CONTEXTS = (512, 2048)


def program_step(checkpoint, recipe_name: str, options: dict, max_seq_len: int):
    """The recipe's program with these recipe options as a runtime step, quantized as a job quantizes it."""
    # loads torch, which bench's driver leaves to the processes it starts
    from models.llama import build_exportable
    from quant.quantize import UnitQuantizer, quantize_module, quantizes_by_unit
    from recipes import generate as gen
    from recipes.lowering import export_program, lower_for_backend
    from recipes.registry import get_recipe
    from recipes.request import recipe_defaults

    recipe = get_recipe(recipe_name)
    options = {**recipe_defaults(recipe), **options}
    form = recipe.export_options(max_seq_len, options)
    if quantizes_by_unit(recipe.quantization, options):
        quantizer = UnitQuantizer(recipe.quantization, options, checkpoint.tokenizer, max_seq_len)
        module = build_exportable(checkpoint.config, checkpoint.state_dict, form, transform_unit=quantizer)
    else:
        module = build_exportable(checkpoint.config, checkpoint.state_dict, form)
        quantize_module(module, recipe.quantization, options, checkpoint.tokenizer, max_seq_len)
    program = export_program(module, max_seq_len, strict=recipe.backend.strict_export)
    lowered = lower_for_backend(program, recipe, options, consume_program=True)
    del module, program
    return gen.runtime_step(gen.load_runtime_method(lowered.pte, recipe.backend.runtime_imports))


def score(contexts: tuple[int, ...]) -> dict:
    # loads torch, which bench's driver leaves to the processes it starts
    from models.checkpoint import load_checkpoint
    from recipes import fidelity

    checkpoint = load_checkpoint(None)
    longest = max(contexts)
    stream = running_text_ids(checkpoint.tokenizer, longest)
    rows = []
    fp32_model = {}  # the first weights' (fp32) program with an fp32 cache: the usual fidelity reference
    for recipe_name, weight_options in WEIGHTS.items():
        reference = {}
        for cache, cache_options in CACHES.items():
            started = time.perf_counter()
            step = program_step(checkpoint, recipe_name, {**weight_options, **cache_options}, longest)
            for context in contexts:
                ids = stream[:context]
                targets = fidelity.targets_of(ids, context)
                if cache == "fp32":
                    reference[context] = fidelity.sequence_logits(step, ids, context)
                    fp32_model.setdefault(context, reference[context])
                figures = fidelity.compare_step(step, ids, context, reference[context], targets)
                # against fp32 weights and cache too: what the cache adds to the weights' own distance
                against_fp32 = fidelity.compare_step(step, ids, context, fp32_model[context], targets)
                rows.append({"weights": recipe_name, **weight_options, "cache": cache, "context": context,
                             "positions": len(targets), **figures,
                             **{f"fp32_model_{k}": against_fp32[k] for k in ("perplexity_ratio", "mean_kl")}})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            rows[-1]["seconds_for_program"] = round(time.perf_counter() - started, 1)
            del step
    return {"rows": rows, "text_tokens": len(stream), "contexts": list(contexts)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_fidelity")
    parser.add_argument("--contexts", default=",".join(str(c) for c in CONTEXTS))
    args = parser.parse_args()
    print(json.dumps(score(tuple(int(c) for c in args.contexts.split(",")))), flush=True)


if __name__ == "__main__":
    main()
