"""Does a static recipe's second method cost a second copy of the weights? The recipe's static module lowered with
`prefill` alone and with `prefill` and `decode` together (the recipe as shipped), each in its own process: the
.pte's bytes, the process's RSS entering the lowering, and the peaks of lowering and serializing (recipes/rss.py).

    python3 -m bench.static_methods [--recipe coreml-ane-c4w] [--model DIR] [--max-seq-len 512] \
        [--out bench/results/static_methods.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

from bench.channelwise import cpu_name
from bench.measure import run_measured

# minmax: the quickest; the program, and so the lowering, is the same for every algorithm
OPTIONS = {"quant_algorithm": "minmax"}


def lower_once(recipe_name: str, methods: list[str], model: str | None, max_seq_len: int) -> dict:
    from recipes.thread_policy import limit_openmp_default  # imports no torch; must run before torch is imported

    limit_openmp_default()
    # the child's imports: after the OpenMP default, which must be set before torch is imported
    from models.checkpoint import load_checkpoint
    from models.llama import build_exportable
    from quant.quantize import UnitQuantizer, cast_quantized
    from recipes import malloc_policy, rss
    from recipes.lowering import lower_for_backend
    from recipes.registry import get_recipe
    from recipes.request import recipe_options
    from recipes.static_program import export_methods, static_form, static_metadata

    malloc_policy.unmap_large_blocks()  # as a job does where it starts (recipes/run.py)
    recipe = get_recipe(recipe_name)
    options = recipe_options(recipe, OPTIONS)
    checkpoint = load_checkpoint(model)
    quantizer = UnitQuantizer(recipe.quantization, options, checkpoint.tokenizer, max_seq_len)
    module = build_exportable(checkpoint.config, checkpoint.state_dict, recipe.export_options(max_seq_len),
                              transform_unit=quantizer if recipe.quantization != "fp32" else None)
    static = static_form(cast_quantized(module, recipe.quantization), options)
    programs = export_methods(static, int(options["prefill_chunk"]), strict=recipe.backend.strict_export)
    programs = {name: programs[name] for name in methods}
    entering = rss.rss_bytes() / rss.MB
    with tempfile.TemporaryDirectory() as folder:
        lowered = lower_for_backend(programs, recipe, options,
                                    constant_methods=static_metadata(static, int(options["prefill_chunk"])),
                                    pte_path=Path(folder) / "model.pte")
    return {"recipe": recipe_name, "methods": methods, "pte_bytes": lowered.pte_bytes,
            "rss_entering_lowering_mb": round(entering, 1), "lower_peak_rss_mb": lowered.lower_peak_rss_mb,
            "serialize_peak_rss_mb": lowered.serialize_peak_rss_mb, "lower_s": round(lowered.lower_s, 1),
            "delegated_subgraphs": lowered.delegation["delegated_subgraphs"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="coreml-ane-c4w")
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--out", default="bench/results/static_methods.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: comma-separated methods
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(lower_once(args.recipe, args.one.split(","), args.model, args.max_seq_len)), flush=True)
        return
    rows = []
    for methods in ("prefill", "prefill,decode"):
        cmd = [sys.executable, "-m", "bench.static_methods", "--recipe", args.recipe, "--max-seq-len",
               str(args.max_seq_len), "--one", methods, *(["--model", args.model] if args.model else [])]
        measured = run_measured(cmd, Path(args.out).with_suffix(f".{methods.replace(',', '-')}.log"))
        rows.append({**(measured["result"] or {}), "process_peak_rss_mb": measured["peak_rss_mb"],
                     "returncode": measured["returncode"]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"date": date.today().isoformat(), "cpu": cpu_name(), "model": args.model or "built-in SmolLM2-135M",
              "max_seq_len": args.max_seq_len, "options": OPTIONS, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
