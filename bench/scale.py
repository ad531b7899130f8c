"""Phase `scale`: Lowerbench on the shapes people ship (bench/scale_models.py: random bf16 checkpoints with
the published configs), plus the built-in 135M model, one process at a time: export wall time, the peak RSS
of each stage (the report's memory section, recipes/process/rss.py) and of the whole process tree, the .pte's size,
and prefill/decode tok/s of that .pte on the ExecuTorch runtime, in Lowerbench's step loop (bench/decode.py)
and in ExecuTorch's own LLM runner (bench/runner.py). optimum-cli exports the
same checkpoint in turn (A B A B) when bench/setup.sh has built its venv. A shape whose export-only estimate
(recipes/estimates/memory_estimate.py) is over --scale-memory-gb is not run; the reason is recorded.

Random weights time exactly as real ones: see bench/scale_models.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.checkpoints import hf_folder
from bench.measure import paired_ratio_by_run, run_measured
from bench.runner import RUNNER
from bench.scale_models import CONFIGS, make_checkpoint, parameter_count
from recipes.output.report import Report, load_report

SHAPES = ("smollm2-135m", "llama-3.2-1b", "tinyllama-1.1b", "qwen3-1.7b", "llama-3.2-3b", "llama-3.1-8b")
RECIPE = "xnnpack-8da4w"
# optimum-cli's int4 qparams (HQQ scale-only), which RECIPE is exported with here so both tools do the same work
PEER_QPARAMS = "hqq"
PEER_ALGORITHM = ("--quant-algorithm", PEER_QPARAMS)
# --scale-algorithms' name for Lowerbench's own default (no --quant-algorithm): what a user who keeps it waits
DEFAULT_ALGORITHM = "default"
SPEEDS = ("prefill_tokens_per_s", "decode_tokens_per_s")
# Shapes optimum-cli is not run on, and why.
OPTIMUM_OUT_OF_REACH = {
    "llama-3.1-8b": "optimum-cli peaked at 18.9 GB of RSS exporting Llama-3.2-3B's shape (2.5x fewer parameters) in "
                    "this phase; Llama-3.1-8B's export would need well over the 24 GiB of the machines it runs on",
}


def lowerbench_peer(algorithm: str) -> str:
    """The scale peer's name of RECIPE exported with `algorithm` (PEER_QPARAMS keeps the name earlier runs used)."""
    return f"lowerbench {RECIPE}" if algorithm == PEER_QPARAMS else f"lowerbench {RECIPE} {algorithm}"


def algorithm_options(algorithm: str) -> tuple[str, ...]:
    """The `recipes run` flags that export RECIPE with `algorithm`."""
    return () if algorithm == DEFAULT_ALGORITHM else ("--quant-algorithm", algorithm)


def peer_of_engine(engine: str) -> str:
    """The export peer whose .pte a decode engine runs."""
    program = engine.split(" · ")[0]  # the step loop's engine, or the program in the runner (in_runner)
    return {"lowerbench-pte": f"lowerbench {RECIPE}", "optimum-pte": "optimum"}.get(program, engine)


def checkpoint_folder(name: str, cache: Path) -> Path:
    return hf_folder() if name == "smollm2-135m" else make_checkpoint(name, cache / name)


def config_of(name: str, folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def export_only_estimate_gb(config: dict, recipes: list[str], generate: bool = False) -> float:
    from transformers import LlamaConfig

    # these load torch, which bench's driver needs only here
    from recipes.estimates.memory_estimate import estimate_job
    from recipes.registry import get_recipe

    estimate = estimate_job(LlamaConfig(**config), [get_recipe(r) for r in recipes], 512, generate,
                            budget_bytes=10**12)
    return round(estimate.peak_rss_bytes / 1e9, 2)


def lowerbench_cmd(py: str, folder: Path | None, out: Path, recipe: str, max_seq_len: int, full: bool,
                   options: tuple[str, ...] = ()) -> list[str]:
    """folder None: the built-in model. options: more `recipes run` flags, e.g. ("--group-size", "64")."""
    return [py, "-m", "recipes", "run", *([] if folder is None else ["--model", str(folder)]), "--recipe", recipe,
            "--max-seq-len", str(max_seq_len), *options, *([] if full else ["--export-only"]), "--out", str(out)]


def report_figures(report: Report) -> dict:
    """What a scale run keeps of its job's report.json, in the run's own record (`stored_report` reads it back)."""
    return {"timings_s": report.timings.to_dict(), "memory": report.memory.to_dict() if report.memory else None,
            "pte_bytes": report.pte.bytes if report.pte else None,
            "ptd_bytes": report.pte.ptd_bytes if report.pte else None, "errors": [e.to_dict() for e in report.errors],
            "generations": [g.to_dict() for g in report.generations],
            "fidelity": report.fidelity.to_dict() if report.fidelity else None}


def stored_report(run: dict) -> Report:
    """A run's stored figures (report_figures) as the Report they came from; empty for a run without one."""
    figures = {key: run[key] for key in ("timings_s", "memory", "errors", "generations", "fidelity")
               if run.get(key) is not None}
    return Report.from_dict({**figures, "pte": {"bytes": run.get("pte_bytes"), "ptd_bytes": run.get("ptd_bytes")}})


def program_bytes(run: dict) -> int | None:
    """The program's files: the .pte, and the .ptd beside it when the job wrote its weights there."""
    return (run.get("pte_bytes") or 0) + (run.get("ptd_bytes") or 0) or None


def phase_scale(args, tmp: Path, py: str, root: Path, optimum_cmd, optimum_why_not, progress) -> dict:
    cache = Path(args.scale_dir)
    shapes = [s for s in args.shapes.split(",") if s]
    recipes = [r for r in args.scale_recipes.split(",") if r]
    runs, skipped, decode = [], {}, []
    for shape in shapes:
        if shape not in SHAPES:
            raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        config = CONFIGS.get(shape)
        if config is not None:
            estimate = export_only_estimate_gb(config, [RECIPE])
            if estimate > args.scale_memory_gb:
                skipped[shape] = f"export-only estimate {estimate} GB is over --scale-memory-gb {args.scale_memory_gb}"
                continue
        folder = checkpoint_folder(shape, cache)
        config = config_of(shape, folder)
        # (recipe, full job, recipe options) by peer
        peers = {f"lowerbench {r}": (r, False, ()) for r in recipes if r != RECIPE}
        for algorithm in [a for a in args.scale_algorithms.split(",") if a] if RECIPE in recipes else []:
            peers[lowerbench_peer(algorithm)] = (RECIPE, False, algorithm_options(algorithm))
        if args.scale_full:
            peers[f"lowerbench {RECIPE} full job"] = (RECIPE, True, PEER_ALGORITHM)
        for i in range(args.runs):
            for peer, (recipe, full, options) in peers.items():
                out = tmp / "scale" / shape / f"{peer.replace(' ', '-')}-{i}"
                shutil.rmtree(out, ignore_errors=True)
                cmd = lowerbench_cmd(py, folder, out, recipe, 512, full, options)
                record = run_measured(cmd, tmp / "logs" / f"scale-{shape}-{peer.replace(' ', '-')}-{i}.log", cwd=root,
                                      timeout_s=args.export_timeout)
                report = out / "report.json"
                record.update(shape=shape, peer=peer, recipe=recipe, full_job=full, run=i, config=config,
                              estimate_gb=export_only_estimate_gb(config, [recipe], full),
                              **(report_figures(load_report(report)) if report.is_file() else dict.fromkeys(
                                  ("timings_s", "memory", "pte_bytes", "errors", "generations", "fidelity"))))
                runs.append(record)
                progress(f"scale {shape} {peer} run {i}: {record['wall_s']} s, {record['peak_rss_mb']} MB, "
                         f"rc {record['returncode']}")
            if optimum_why_not is None and "optimum" not in args.skip and shape not in OPTIMUM_OUT_OF_REACH:
                out = tmp / "scale" / shape / f"optimum-{i}"
                shutil.rmtree(out, ignore_errors=True)
                record = run_measured(optimum_cmd(folder, out), tmp / "logs" / f"scale-{shape}-optimum-{i}.log",
                                      cwd=root, timeout_s=args.export_timeout)
                pte = next(iter(sorted(out.glob("*.pte"))), None)
                record.update(shape=shape, peer="optimum", run=i, pte_bytes=pte.stat().st_size if pte else None)
                runs.append(record)
                progress(f"scale {shape} optimum run {i}: {record['wall_s']} s, {record['peak_rss_mb']} MB")
        if optimum_why_not is not None or "optimum" in args.skip or shape in OPTIMUM_OUT_OF_REACH:
            skipped[f"{shape} optimum"] = (optimum_why_not or OPTIMUM_OUT_OF_REACH.get(shape)
                                           or "skipped with --skip")
        programs = {"lowerbench-pte": next(iter(sorted((tmp / "scale" / shape).glob(
            f"lowerbench-{RECIPE}*-0/model.pte"))), None),
            "optimum-pte": next(iter(sorted((tmp / "scale" / shape / "optimum-0").glob("*.pte"))), None)}
        programs = {engine: pte for engine, pte in programs.items() if pte is not None}
        # Both programs on the same runtime loop, taking turns in every run (A B A B), so a busy spell of the
        # machine falls on both sides of each ratio.
        for i in range(args.runs):
            for engine, pte in programs.items():
                record = run_measured(decode_cmd(py, engine, pte, folder, args),
                                      tmp / "logs" / f"scale-{shape}-{engine}-decode-{i}.log", cwd=root)
                record.update(shape=shape, engine=engine, run=i)
                decode.append(record)
                progress(f"scale {shape} {engine} decode run {i}: "
                         f"{(record['result'] or {}).get('decode_tokens_per_s')} tok/s")
                # the same program in ExecuTorch's own LLM runner, as a device app runs it
                cmd = [py, "-m", "bench.runner", "--pte", str(pte), "--tokenizer-json", str(folder / "tokenizer.json"),
                       "--hf", str(folder), *_generation_args(args)]
                record = run_measured(cmd, tmp / "logs" / f"scale-{shape}-{engine}-runner-{i}.log", cwd=root)
                record.update(shape=shape, engine=in_runner(engine), run=i)
                decode.append(record)
                progress(f"scale {shape} {in_runner(engine)} run {i}: "
                         f"{(record['result'] or {}).get('decode_tokens_per_s')} tok/s")
    return {"runs": runs, "decode": decode, "skipped": skipped,
            "settings": {"max_seq_len": 512, "shapes": shapes, "recipes": recipes, "full_job": args.scale_full,
                         "checkpoints": "random bf16 safetensors with the published configs (bench/scale_models.py); "
                                        "smollm2-135m: the built-in model as an fp32 folder"}}


def summarize_scale(data: dict) -> dict:
    from statistics import median

    rows, checks = [], []
    for key in dict.fromkeys((r["shape"], r["peer"]) for r in data["runs"]):
        mine = [r for r in data["runs"] if (r["shape"], r["peer"]) == key and r["returncode"] == 0]
        if not mine:
            rows.append({"shape": key[0], "peer": key[1], "runs": 0})
            continue
        row = {"shape": key[0], "peer": key[1], "runs": len(mine), "params": params_of(data, key[0]),
               "wall_s": round(median(r["wall_s"] for r in mine), 1),
               "peak_rss_mb": round(median(r["peak_rss_mb"] for r in mine), 1),
               "pte_mb": round(program_bytes(mine[0]) / 1e6, 1) if program_bytes(mine[0]) else None}
        memory = stored_report(mine[0]).memory
        if memory is not None:
            row["stage_peaks_mb"] = memory.peak_rss_mb_by_stage
            row["estimate_gb"] = mine[0]["estimate_gb"]
        rows.append(row)
        if key[1].startswith("lowerbench") and memory is not None:
            checks.append({"model": key[0], "recipes": [mine[0]["recipe"]], "generate": mine[0]["full_job"],
                           "max_seq_len": 512, "config": mine[0].get("config") or None,
                           "peak_rss_mb": row["peak_rss_mb"], "estimate_at_run_gb": mine[0]["estimate_gb"],
                           "reference_dtype": memory.estimate.reference_dtype if memory.estimate else None})
    decode = []
    for shape, engine in dict.fromkeys((r["shape"], r["engine"]) for r in data.get("decode", [])):
        results = [r["result"] for r in data["decode"] if (r["shape"], r["engine"]) == (shape, engine)
                   and r["returncode"] == 0 and r["result"]]
        decode.append({"shape": shape, "engine": engine, "runs": len(results),
                       **({"prompt_tokens": results[0]["prompt_tokens"], "new_tokens": results[0]["new_tokens"]}
                          if results else {}),
                       **{key: median(r.get(key) for r in results)
                          for key in ("prefill_tokens_per_s", "decode_tokens_per_s")}})
    return {"shapes": rows, "decode_summary": decode, "estimate_checks": checks,
            "ratios": scale_ratios(data)}


def _generation_args(args) -> list[str]:
    return ["--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]


def decode_cmd(py: str, engine: str, pte: Path, folder: Path, args) -> list[str]:
    """Prefill/decode of one .pte in Lowerbench's step loop on the ExecuTorch runtime (bench/decode.py; engine
    lowerbench-pte or optimum-pte), its tokenizer from the checkpoint `folder`."""
    return [py, "-m", "bench.decode", engine, "--pte", str(pte), "--hf", str(folder), *_generation_args(args)]


def in_runner(engine: str) -> str:
    """The decode record's engine name for a program run in ExecuTorch's LLM runner (bench/runner.py)."""
    return f"{engine} · {RUNNER}"


def params_of(data: dict, shape: str) -> int | None:
    config = next((r["config"] for r in data["runs"] if r["shape"] == shape and r.get("config")), None)
    return parameter_count(config) if config else None


def scale_ratios(data: dict) -> list[dict]:
    """Per shape, Lowerbench's export-only xnnpack-8da4w ÷ optimum-cli's: wall time, peak RSS and .pte size;
    and its .pte's prefill/decode ÷ optimum's on the same runtime loop."""
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in data["runs"]):
        exports = [r for r in data["runs"] if r["shape"] == shape and r["returncode"] == 0
                   and r["peer"] in ("optimum", f"lowerbench {RECIPE}")]
        runs = [r for r in data.get("decode", []) if r["shape"] == shape and r["returncode"] == 0 and r["result"]]

        def export_ratio(value):
            return paired_ratio_by_run(exports, f"lowerbench {RECIPE}", "optimum", lambda r: r["peer"], value)

        def decode_ratio(key, loop=lambda engine: engine):
            return paired_ratio_by_run(runs, loop("lowerbench-pte"), loop("optimum-pte"), lambda r: r["engine"],
                                       lambda r: r["result"].get(key))

        default = [r for r in data["runs"] if r["shape"] == shape and r["returncode"] == 0
                   and r["peer"] in ("optimum", lowerbench_peer(DEFAULT_ALGORITHM))]
        row = {"shape": shape, "lowerbench_over_optimum": {
            "export_wall": export_ratio(lambda r: r["wall_s"]),
            # Lowerbench's default algorithm against optimum's export, in the same runs
            "default_export_wall": paired_ratio_by_run(default, lowerbench_peer(DEFAULT_ALGORITHM), "optimum",
                                                       lambda r: r["peer"], lambda r: r["wall_s"]),
            "peak_rss": export_ratio(lambda r: r["peak_rss_mb"]),
            "pte_bytes": export_ratio(program_bytes),
            **{key: decode_ratio(key) for key in SPEEDS},
            **{f"runner_{key}": decode_ratio(key, in_runner) for key in SPEEDS}}}
        if any(v is not None for v in row["lowerbench_over_optimum"].values()):
            ratios.append(row)
    return ratios
