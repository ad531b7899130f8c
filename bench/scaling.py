"""Export the first N decoder layers of a Hugging Face folder with Lowerbench's own functions
(xnnpack-8da4w, with optimum-cli's qparams), in this process; prints one JSON line of stage seconds.

    python -m bench.scaling --hf FOLDER --layers N [--max-seq-len 512]"""
from __future__ import annotations

import argparse
import json
import time

from bench.checkpoints import truncated
from bench.scale import PEER_QPARAMS
from models.checkpoint import load_folder
from models.llama import build_exportable
from quant.schemes import SCHEMES, apply_scheme
from recipes.lowering import export_program, lower_for_backend
from recipes.registry import get_recipe


def export_recipe(config, state: dict, recipe_name: str, max_seq_len: int) -> tuple[dict, object]:
    """Checkpoint weights -> lowered .pte with Lowerbench's own functions; (stage seconds, LoweredProgram)."""
    recipe = get_recipe(recipe_name)
    timings = {}
    start = time.perf_counter()
    module = build_exportable(config, state, recipe.export_options(max_seq_len))
    offered = SCHEMES[recipe.quantization].algorithms
    apply_scheme(module, recipe.quantization, recipe.options.get("group_size"),
                 PEER_QPARAMS if PEER_QPARAMS in offered else None)
    timings["quantize"] = time.perf_counter() - start
    start = time.perf_counter()
    program = export_program(module, max_seq_len, strict=recipe.backend.strict_export)
    timings["export"] = time.perf_counter() - start
    lowered = lower_for_backend(program, recipe, recipe.options)
    timings["lower"], timings["serialize"] = lowered.lower_s, lowered.serialize_s
    return timings, lowered


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--recipe", default="xnnpack-8da4w")
    args = parser.parse_args()
    start = time.perf_counter()
    checkpoint = load_folder(args.hf)
    config, state = truncated(checkpoint.config, checkpoint.state_dict, args.layers)
    load_s = time.perf_counter() - start
    stages, lowered = export_recipe(config, state, args.recipe, args.max_seq_len)
    timings = {k: round(v, 3) for k, v in {"load": load_s, **stages}.items()}
    timings["export_path"] = round(sum(timings[k] for k in ("quantize", "export", "lower", "serialize")), 3)
    print(json.dumps({"layers": args.layers, "timings_s": timings, "pte_bytes": len(lowered.pte)}), flush=True)


if __name__ == "__main__":
    main()
