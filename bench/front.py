"""Phase `front`: the speed–quality front of xnnpack-8da4w (int8 dynamic activations, int4 group-wise weights).
A larger weight group means fewer bf16 scales to read per token, so faster decode, but coarser weights.

On the built-in model (real weights): one full job per weight algorithm (minmax, hqq, awq, spinquant, gptq,
awq-gptq) and group size that divides the model's linear input widths (from its config), plus hqq and awq-gptq at
group 32 with the most sensitive linears kept at 8 bits within a 15 % byte budget. Each job reports its weight bytes
per token, its perplexity ratio and top-1 agreement against fp32 eager on the evaluation and the held-out text (on
the ExecuTorch runtime) and its quantize time. Then every job's .pte is timed like the random-weight shapes'
(below): a sample generation is too short to time. All rows come from one invocation, so the speed comparison
against optimum-executorch's default (HQQ scale-only qparams, group 32) sees the same machine state and the same engine.

On the shipped shapes (bench/scale_models.py: random bf16 checkpoints with the published configs): one
export-only job per fitting group size with minmax, then prefill/decode of each .pte on the ExecuTorch
runtime (bench/decode.py), the programs in turn within every run (A B A B). The algorithm only chooses the
int4 values and their scales (and SpinQuant's rotations fold into the weights): the program, its kernels and
its bytes per token are the same for every algorithm at one group size, which the built-in rows show. So
one algorithm times them all; fidelity needs real weights and is not measured on random ones."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.measure import median, run_measured
from bench.scale import RECIPE, checkpoint_folder, decode_cmd, lowerbench_cmd
from recipes.output.report import Fidelity, Generation, Heldout, Quantization, Report, load_report

ALGORITHMS = ("minmax", "hqq", "awq", "spinquant", "gptq", "awq-gptq")
# the algorithms that also get a job with the most sensitive linears at 8 bits, at this group and budget
MIXED_ALGORITHMS = ("hqq", "awq-gptq")
MIXED_PRECISION = {"group_size": 32, "mixed_precision_budget": 0.15}
# optimum-cli export executorch --qlinear 8da4w: HQQ scale-only qparams (optimum-executorch's
# DEFAULT_QPARAMS_ALGORITHM since 1.1.0), group 32 (bench/__main__.py optimum_export_cmd)
DEFAULT = {"algorithm": "hqq", "group_size": 32, "mixed_precision_budget": 0.0}
# The app's own sample generation first: ExecuTorch's LLM runner, then the Python step loop on the runtime.
GENERATION_ENGINES = ("executorch-llm-runner", "executorch-runtime")
MAX_SEQ_LEN = 512
BUILTIN = "smollm2-135m"
RANDOM_WEIGHTS = "not measured: random weights"
TIMED_ENGINE = "lowerbench-pte (executorch-runtime step loop)"


def fitting_group_sizes(config: dict, candidates) -> list[int]:
    """The candidate group sizes that divide every linear's input width of a Llama config, in the given order."""
    from transformers import LlamaConfig

    from quant.schemes import linear_input_dims  # loads torch, which bench's driver needs only here

    widths = linear_input_dims(LlamaConfig(**config)).values()
    return [g for g in candidates if all(width % g == 0 for width in widths)]


def builtin_jobs(groups: list[int], algorithms=ALGORITHMS, mixed=MIXED_ALGORITHMS) -> list[dict]:
    """Every algorithm at every group size, each followed by its mixed-precision job (for those of `mixed`); the
    default and its group neighbours first, so an interrupted invocation (its finished jobs are saved) still has
    a front to compare."""
    jobs = []
    for algorithm in algorithms:
        jobs += [{"algorithm": algorithm, "group_size": g, "mixed_precision_budget": 0.0} for g in groups]
        if algorithm in mixed and MIXED_PRECISION["group_size"] in groups:
            jobs.append({"algorithm": algorithm, **MIXED_PRECISION})
    return jobs


def job_key(record: dict) -> tuple:
    return (record["shape"], record["algorithm"], record["group_size"], record["mixed_precision_budget"])


def job_name(job: dict) -> str:
    budget = job["mixed_precision_budget"]
    return f"{job['algorithm']} g{job['group_size']}" + (f" +8-bit {budget:.0%}" if budget else "")


def job_options(job: dict, full: bool) -> tuple[str, ...]:
    budget = job["mixed_precision_budget"]
    return ("--group-size", str(job["group_size"]), "--quant-algorithm", job["algorithm"],
            *(["--mixed-precision-budget", str(budget)] if budget else []), *(["--no-profile"] if full else []))


def report_extract(report: Report) -> dict:
    """What the front keeps of a job's report.json: its sections as report.json has them, but for the fidelity's
    per-layer map and the generations' token ids; the .pte's size and the recipe's options under keys of their own
    (`extracted_report` reads it back)."""
    fidelity = {k: v for k, v in report.fidelity.to_dict().items() if k != "layers"} if report.fidelity else None
    return {"quantization": report.quantization.to_dict() if report.quantization else None,
            "fidelity": fidelity or None,
            "generations": [{k: v for k, v in g.to_dict().items() if k not in ("tokens", "pieces")}
                            for g in report.generations],
            "timings_s": report.timings.to_dict(), "pte_bytes": report.pte.bytes if report.pte else None,
            "options": report.recipe.options if report.recipe else None, "versions": report.versions,
            "errors": [e.to_dict() for e in report.errors]}


def extracted_report(extract: dict | None) -> Report:
    """A stored extract (report_extract) as the Report it came from, the sections it left out empty."""
    extract = extract or {}
    return Report.from_dict({**extract, "pte": {"bytes": extract.get("pte_bytes")},
                             "recipe": {"options": extract.get("options") or {}}})


def run_job(shape: str, folder: Path | None, job: dict, full: bool, args, tmp: Path, py: str, root: Path) -> dict:
    name = job_name(job).replace(" ", "-").replace("%", "pct")
    out = tmp / "front" / shape / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = lowerbench_cmd(py, folder, out, RECIPE, MAX_SEQ_LEN, full, job_options(job, full))
    record = run_measured(cmd, tmp / "logs" / f"front-{shape}-{name}.log", cwd=root, timeout_s=args.export_timeout)
    report = out / "report.json"
    record.update(shape=shape, full_job=full, **job,
                  report=report_extract(load_report(report)) if report.is_file() else None,
                  pte=str(out / "model.pte"))
    return record


def phase_front(args, hf: Path, tmp: Path, py: str, root: Path, run_interleaved, progress, save) -> dict:
    """save(result so far) after every job, so the jobs an interrupted invocation finished are kept."""
    shapes = [s for s in args.front_shapes.split(",") if s]
    candidates = [int(g) for g in args.front_groups.split(",") if g]
    runs, decode, skipped = [], [], {}
    result = {"runs": runs, "decode": decode, "skipped": skipped,
              "settings": {"recipe": RECIPE, "max_seq_len": MAX_SEQ_LEN, "shapes": shapes,
                           "group_candidates": candidates, "new_tokens": args.new_tokens, "threads": args.threads,
                           "decode_runs": args.runs, "default": DEFAULT,
                           "checkpoints": f"{BUILTIN}: the built-in model (real weights, full jobs); other shapes: "
                                          "random bf16 safetensors with the published configs "
                                          "(bench/scale_models.py), export-only with minmax"}}
    for shape in shapes:
        folder = hf if shape == BUILTIN else checkpoint_folder(shape, Path(args.scale_dir))
        groups = fitting_group_sizes(json.loads((folder / "config.json").read_text()), candidates)
        if shape == BUILTIN:
            for job in builtin_jobs(groups, args.front_algorithms, args.front_mixed):
                record = run_job(shape, None, job, True, args, tmp, py, root)
                runs.append(record)
                row = front_row(record)
                progress(f"front {shape} {job_name(job)}: rc {record['returncode']}, {record['wall_s']} s, "
                         f"ppl ratio {row['perplexity_ratio']}, decode {row['decode_tokens_per_s']} tok/s")
                save(result)
            last = tmp.parent / "front.json"
            earlier = json.loads(last.read_text())["runs"] if args.front_retime and last.is_file() else []
            timed = builtin_programs([*earlier, *runs], shape)
            engines = {f"{shape} {name}": decode_cmd(py, "lowerbench-pte", Path(job["pte"]), folder, args)
                       for name, job in timed.items()}
            for record in run_interleaved("front", engines, args.runs, tmp / "logs"):
                name = record["engine"].removeprefix(f"{shape} ")
                decode.append({**record, "shape": shape, "name": name, "group_size": timed[name]["group_size"]})
            save(result)
            continue
        programs = {}
        for group in groups:
            job = {**DEFAULT, "group_size": group}
            record = run_job(shape, folder, job, False, args, tmp, py, root)
            runs.append(record)
            progress(f"front {shape} {job_name(job)} export-only: rc {record['returncode']}, {record['wall_s']} s, "
                     f"{record['peak_rss_mb']} MB")
            if record["returncode"] == 0 and Path(record["pte"]).is_file():
                programs[group] = Path(record["pte"])
            else:
                skipped[f"{shape} g{group}"] = f"the export failed (see {record['log']})"
            save(result)
        engines = {f"{shape} g{g}": decode_cmd(py, "lowerbench-pte", pte, folder, args) for g, pte in programs.items()}
        for record in run_interleaved("front", engines, args.runs, tmp / "logs"):
            decode.append({**record, "shape": shape, "group_size": int(record["engine"].rsplit(" g", 1)[1])})
        save(result)
        for pte in programs.values():
            shutil.rmtree(pte.parent, ignore_errors=True)  # a 1B program is about a gigabyte
    return result


def builtin_programs(runs: list[dict], shape: str) -> dict[str, dict]:
    """The finished full jobs of `shape` whose .pte is still on disk, by job name (a later run of a job wins): a
    sample generation is too short to time a program, so each is timed again like the random-weight shapes'."""
    return {job_name(r): r for r in runs
            if r["full_job"] and r["shape"] == shape and r["returncode"] == 0 and Path(r["pte"]).is_file()}


def decode_key(record: dict) -> tuple:
    """A decode record's program: (shape, group) of a random-weight shape, plus the job name on the built-in."""
    return record["shape"], record["group_size"], record.get("name")


def keep_unmeasured(old: dict, meta: dict, result: dict) -> None:
    """Runs of jobs (shape, algorithm, group, budget) and programs (shape, group) this invocation did not measure
    stay, so the front fills in piece by piece. A save earlier in the same invocation (same date) is no
    earlier invocation."""
    measured = {job_key(r) for r in result["runs"]}
    timed = {decode_key(r) for r in result["decode"]}
    kept_runs = [r for r in old.get("runs", []) if job_key(r) not in measured]
    kept_decode = [r for r in old.get("decode", []) if decode_key(r) not in timed]
    if kept_runs or kept_decode:
        result["runs"] = kept_runs + result["runs"]
        result["decode"] = kept_decode + result["decode"]
        result["skipped"] = {**old.get("skipped", {}), **result["skipped"]}
        result["settings"]["shapes"] = list(dict.fromkeys([r["shape"] for r in result["runs"]]))
        earlier = old["meta"] if old["meta"]["date"] != meta["date"] else old["meta"].get("earlier_meta")
        if earlier:
            meta["earlier_meta"] = earlier


def recipe_generation(generations: list[Generation]) -> Generation | None:
    """The recipe's own sample generation (not the fp32 reference), on the first engine of GENERATION_ENGINES
    that made one."""
    by_engine = {g.engine: g for g in generations}
    return next((by_engine[e] for e in GENERATION_ENGINES if e in by_engine), None)


def front_row(record: dict) -> dict:
    report = extracted_report(record.get("report"))
    quant, fidelity = report.quantization or Quantization(), report.fidelity or Fidelity()
    heldout, mixed = fidelity.heldout or Heldout(), quant.mixed_precision
    generation = recipe_generation(report.generations)
    bytes_per_token = quant.weight_bytes_per_token
    return {"shape": record["shape"], "name": job_name(record), "algorithm": record["algorithm"],
            "group_size": record["group_size"], "mixed_precision_budget": record["mixed_precision_budget"],
            "ok": record["returncode"] == 0 and bytes_per_token is not None, "full_job": record["full_job"],
            "weight_bytes_per_token": bytes_per_token,
            "weight_mb_per_token": round(bytes_per_token / 1e6, 2) if bytes_per_token else None,
            "pte_mb": round(report.pte.bytes / 1e6, 1) if report.pte.bytes else None,
            "perplexity_ratio": fidelity.perplexity_ratio,
            "top1_agreement_percent": fidelity.top1_agreement_percent,
            "heldout_perplexity_ratio": heldout.perplexity_ratio,
            "heldout_top1_agreement_percent": heldout.top1_agreement_percent,
            "fidelity_engine": fidelity.engine,
            "decode_tokens_per_s": generation.decode_tokens_per_s if generation else None,
            "prefill_tokens_per_s": generation.prefill_tokens_per_s if generation else None,
            "decode_engine": generation.engine if generation else None,
            "new_tokens": generation.new_tokens if generation else None,
            "quantize_s": report.timings.quantize, "wall_s": record["wall_s"], "peak_rss_mb": record["peak_rss_mb"],
            "units_8bit": mixed.units_8bit if mixed else None,
            "extra_bytes_per_token": mixed.extra_bytes_per_token if mixed else None}


def is_default(row: dict) -> bool:
    return (row["algorithm"], row["group_size"], row["mixed_precision_budget"]) == tuple(DEFAULT.values())


def beats_default(row: dict, default: dict | None, noise: float = 0.0) -> bool:
    """Faster decode on the same engine, by more than the fraction `noise`, and a lower perplexity ratio than
    the default's row of the same model, both measured."""
    if default is None or is_default(row) or row["shape"] != default["shape"]:
        return False
    speeds = (row.get("decode_tokens_per_s"), default.get("decode_tokens_per_s"))
    ratios = (row.get("perplexity_ratio"), default.get("perplexity_ratio"))
    if None in speeds or None in ratios or row.get("decode_engine") != default.get("decode_engine"):
        return False
    return speeds[0] > speeds[1] * (1 + noise) and ratios[0] < ratios[1]


def timed_decode(row: dict, records: list[dict]) -> dict:
    """The row's program's median prefill/decode over its timed runs, when it was timed."""
    timed = [r["result"] for r in records if r["returncode"] == 0 and r["result"]]
    if not timed:
        return {}
    return {"decode_tokens_per_s": median([t["decode_tokens_per_s"] for t in timed]),
            "prefill_tokens_per_s": median([t["prefill_tokens_per_s"] for t in timed]),
            "decode_engine": TIMED_ENGINE, "decode_runs": len(timed), "new_tokens": timed[0]["new_tokens"]}


def program_rows(data: dict) -> list[dict]:
    """Export-only rows of the random-weight shapes, with their .pte's median prefill/decode over the runs."""
    rows = []
    for record in data["runs"]:
        if record["full_job"]:
            continue
        row = front_row(record)
        timed = [r for r in data.get("decode", []) if decode_key(r) == (row["shape"], row["group_size"], None)]
        row.update(decode_tokens_per_s=None, prefill_tokens_per_s=None, decode_engine=None, decode_runs=0,
                   new_tokens=None, perplexity_ratio=None, fidelity_engine=RANDOM_WEIGHTS)
        row.update(timed_decode(row, timed))
        rows.append(row)
    return rows


def same_bytes_across_algorithms(rows: list[dict]) -> dict[str, dict]:
    """Per model and group (no 8-bit layers): the algorithms measured and whether their programs read the same
    bytes per token."""
    found: dict[str, dict] = {}
    for row in rows:
        if row["ok"] and not row["mixed_precision_budget"]:
            seen = found.setdefault(f"{row['shape']} g{row['group_size']}", {"algorithms": [], "bytes": set()})
            seen["algorithms"].append(row["algorithm"])
            seen["bytes"].add(row["weight_bytes_per_token"])
    return {key: {"algorithms": seen["algorithms"], "same": len(seen["bytes"]) == 1} for key, seen in found.items()}


def same_program_decode_range(rows: list[dict]) -> dict[str, list[float]]:
    """Per model and group, the decode tok/s range over the algorithms' rows: one program, so its spread is
    the run-to-run noise a speed comparison has to beat."""
    found: dict[str, list] = {}
    for row in rows:
        if row["ok"] and not row["mixed_precision_budget"] and row["decode_tokens_per_s"]:
            found.setdefault(f"{row['shape']} g{row['group_size']}", []).append(row["decode_tokens_per_s"])
    return {key: [min(v), max(v)] for key, v in found.items() if len(v) > 1}


def decode_noise(spread: dict[str, list[float]]) -> float:
    """The largest relative spread of one program's decode speed: a smaller speed-up is not one."""
    return round(max((hi / lo - 1 for lo, hi in spread.values()), default=0.0), 4)


def summarize_front(data: dict) -> dict:
    builtin = [front_row(r) for r in data["runs"] if r["full_job"]]
    for row in builtin:
        row.update(timed_decode(row, [r for r in data.get("decode", [])
                                      if decode_key(r) == (row["shape"], row["group_size"], row["name"])]))
    defaults = {row["shape"]: row for row in builtin if is_default(row) and row["ok"]}
    spread = same_program_decode_range(builtin)
    noise = decode_noise(spread)
    for row in builtin:
        row["beats_default"] = beats_default(row, defaults.get(row["shape"]), noise)
    programs = program_rows(data)
    for row in programs:
        row["beats_default"] = None
    return {"rows": builtin + programs, "same_bytes_across_algorithms": same_bytes_across_algorithms(builtin),
            "same_program_decode_range": spread, "decode_noise": noise}
