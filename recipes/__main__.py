"""Headless Lowerbench: `python -m recipes list` and `python -m recipes run ...` (the zoo's matrix: `python -m zoo`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from models.errors import UserFacingError
from recipes.process import thread_policy
from recipes.process.dependency_noise import silence_dependency_noise
from recipes.process.runtime_log import LOG_NAME, runtime_log_to
from recipes.output.summary import summary_rows, text_table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipes", description="Lower a Llama checkpoint with ExecuTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the recipes")
    run = sub.add_parser("run", help="run one or more recipes")
    run.add_argument("--model", help="Hub repo id, local folder or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    run.add_argument("--revision", help="Hub revision (branch, tag or commit)")
    run.add_argument("--adapter", metavar="PATH_OR_REPO",
                     help="a PEFT LoRA adapter (local folder or Hub repo id) merged into the weights before "
                          "quantization")
    run.add_argument("--adapter-revision", metavar="REV", help="the adapter's Hub revision (branch, tag or commit)")
    run.add_argument("--recipe", action="append", required=True, help="recipe name; repeat for several")
    run.add_argument("--out", required=True, type=Path, help="output folder")
    run.add_argument("--prompt", default=None)
    run.add_argument("--max-new-tokens", type=int, default=32)
    run.add_argument("--max-seq-len", type=int, default=512)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--top-p", type=float, default=1.0)
    run.add_argument("--group-size", type=int, default=None, help="weight quantization group size")
    run.add_argument("--quant-algorithm", default=None, help=quant_algorithm_help())
    run.add_argument("--mixed-precision-budget", type=float, default=None,
                     help="keep at 8da8w the linears (of the decoder layers, and the output layer) that bring "
                          "the logits closest to fp32 per byte, within this extra fraction of weight bytes per "
                          "token, e.g. 0.1 for +10 %% (8da4w schemes)")
    run.add_argument("--calibration-file", type=Path, default=None, metavar="PATH",
                     help="your own calibration text in place of the built-in one, for AWQ, GPTQ, the "
                          "mixed-precision search and the PT2E (QNN) recipes: UTF-8 text, or a .jsonl file with a "
                          "chat a line ({\"messages\": [{\"role\", \"content\"}, ...]}), formatted with the "
                          "model's chat template; the fidelity texts stay the same")
    run.add_argument("--kv-cache", choices=("fp32", "fp16", "int8"), default=None,
                     help="how the KV caches are stored: fp32, fp16, or int8 per token and head, read by "
                          "ExecuTorch's quantized SDPA (XNNPACK recipes; default: as the model computes)")
    run.add_argument("--kv-cache-window", type=int, default=None, metavar="N",
                     help="keep the first 4 tokens and a ring of the N most recent ones, so a chat goes on past "
                          "the context in ExecuTorch's LLM runner (XNNPACK recipes; default: no ring)")
    run.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                     help="a recipe option, e.g. soc=SM8750 or layers_per_shard=2 for the QNN recipes; repeat for "
                          "several (`list` shows each recipe's options)")
    run.add_argument("--allow-pickle", action="store_true", help="allow .bin/.pth checkpoints (weights_only load)")
    run.add_argument("--export-only", action="store_true",
                     help="write the .pte and its delegation report only: no sample generations, no fidelity")
    run.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                     help="after the timed generation, an event-traced pass on the ExecuTorch runtime: the report's "
                          "per-op profile, and model.etdump and prefill.etdump beside model.pte")
    run.add_argument("--layer-map", action="store_true",
                     help="also map each decoder layer's error against fp32 (SQNR, relative error): on the runtime "
                          "this costs a second export and lowering")
    run.add_argument("--weights-file", action=argparse.BooleanOptionalAction, default=None,
                     help="write the weights to model.ptd beside model.pte (backends that can: XNNPACK); "
                          "default: above 2 GiB of program")
    run.add_argument("--etrecord", action="store_true",
                     help="also write etrecord.bin (ExecuTorch's ETRecord, for its Inspector and Model Explorer)")
    run.add_argument("--json", action="store_true",
                     help="print the summary rows as JSON (the labels of summary.json) instead of a table")
    return parser


def quant_algorithm_help() -> str:
    """--quant-algorithm's help: every algorithm of the table with its one-line description."""
    from quant.algorithms import ALGORITHMS  # loads torch: called from main, after the thread policy

    described = "; ".join(f"{name}: {algorithm.description}" for name, algorithm in ALGORITHMS.items())
    return f"how int4 weights get their qparams (each scheme's default: see `list`). {described}".replace("%", "%%")


def list_recipes() -> str:
    # these load torch, which main() lets load only after thread_policy.limit_openmp_default()
    from recipes.registry import compatibility_table, load_backends
    from recipes.request import recipe_defaults

    registry = load_backends()
    lines = [f"{'recipe':<18} {'backend':<9} {'quantization':<14} description"]
    for recipe in sorted(registry.recipes.values(), key=lambda r: r.name):
        options = ", ".join(f"{key}={value}" for key, value in recipe_defaults(recipe).items())
        lines.append(f"{recipe.name:<18} {recipe.backend.name:<9} {recipe.quantization:<14} {recipe.description}"
                     + (f" [--option {options}]" if options else ""))
    lines += ["", "where each backend's .pte runs:"]
    lines += [f"  {backend.name:<9} {backend.runs_on}" for backend in registry.backends.values()]
    lines += ["", "schemes each backend takes (--group-size applies to group-wise schemes):", compatibility_table()]
    if registry.unavailable:
        lines += ["", "unavailable backend modules:"]
        lines += [f"  {module}: {why}" for module, why in registry.unavailable.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    thread_policy.limit_openmp_default()  # before anything loads torch
    silence_dependency_noise()  # before torchao is imported: it logs at import
    args = _parser().parse_args(argv)
    if args.command == "list":
        print(list_recipes())
        return 0
    # torch loads here, after thread_policy.limit_openmp_default()
    from recipes.running.generate import DEFAULT_PROMPT
    from recipes.request import RunRequest, recipe_option_pairs, user_options
    from recipes.pipeline.run import run

    try:
        options = {**recipe_option_pairs(args.option),
                   **user_options(args.group_size, args.quant_algorithm, args.mixed_precision_budget,
                                  args.kv_cache, args.kv_cache_window)}
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    request = RunRequest(
        recipes=args.recipe, out_dir=args.out, model=args.model, revision=args.revision,
        token=os.environ.get("HF_TOKEN"), allow_pickle=args.allow_pickle,
        prompt=DEFAULT_PROMPT if args.prompt is None else args.prompt,
        max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
        temperature=args.temperature, top_p=args.top_p, options=options, generate=not args.export_only,
        profile=args.profile, etrecord=args.etrecord, layer_map=args.layer_map, weights_file=args.weights_file,
        calibration_file=args.calibration_file,
        adapter=args.adapter, adapter_revision=args.adapter_revision,
    )
    try:
        with runtime_log_to(Path(args.out) / LOG_NAME):  # ExecuTorch's C++ log beside the reports, not on the terminal
            summary = run(request, progress=lambda f, msg: print(f"[{f:4.0%}] {msg}", file=sys.stderr, flush=True))
    except UserFacingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # disk full or unwritable --out: nothing partial is left (writes are atomic)
        print(f"error: could not write to {args.out}: {err.strerror or err}; free space or choose another --out.",
              file=sys.stderr)
        return 2
    rows = summary_rows(summary)
    print(json.dumps(rows, indent=2, ensure_ascii=False) if args.json else text_table(rows))
    failed = [report for report in summary.recipes if report.errors]
    for report in failed:
        print(f"error: {report.recipe.name}: {report.errors[0].message}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
