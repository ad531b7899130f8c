"""Lowerbench against its peers, in one run: decode speed and export cost.

    python3 -m bench [--runs 3] [--phases decode,export]
    python3 -m bench --phases scale --runs 1 --shapes smollm2-135m,llama-3.2-1b --scale-full
                                                    (the 1B/3B shapes, bench/scale.py; not a default phase)
    python3 -m bench --phases versions --runs 2 --baseline-python OTHER/bin/python --baseline-root OTHER_CHECKOUT
                                                    (this install against another, e.g. the previous executorch
                                                     pin, bench/versions.py; not a default phase)
    python3 -m bench --phases front --runs 3 --scale-dir DIR
                                                    (int4 group size and weight algorithm against weight bytes,
                                                     decode speed and fidelity, bench/front.py; not a default phase)
    python3 -m bench --phases runner --runs 5       (ExecuTorch's LLM runner on Lowerbench's and optimum's .pte,
                                                     and the Python step loop on both, bench/runner.py)
    python3 -m bench --phases kv --runs 3           (the LLM runner at positions 512, 2048 and 8192 of one long
                                                     context, fp32 and int8 KV caches and optimum's .pte, bench/kv.py;
                                                     --kv-shape llama-3.2-1b --scale-dir DIR for that shape, in
                                                     kv-llama-3.2-1b.json)

Every measurement runs in a fresh child process (bench/measure.py: wall time, peak RSS of the child's
process tree); peers are interleaved run by run (A B A B ...) and each figure is the median over runs.
Results: bench/results/<phase>.json, bench/results/README.md (tables), bench/results/*.png.
`bash bench/setup.sh` first (llama-cpp-python, matplotlib, the optimum-executorch venv)."""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from bench import front, kv, scale, table
from bench import versions as versions_phase
from bench.checkpoints import builtin_gguf, hf_folder
from bench.front import ALGORITHMS as front_algorithms, MIXED_ALGORITHMS as front_mixed
from bench.measure import median, run_measured
from bench.memory import decode_weight_bytes_per_token
from bench.runner import LONG_ANSWER_PROMPT, summarize_runner
from bench.scale import PEER_ALGORITHM, RECIPE
from recipes.output.report import load_report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TMP = RESULTS / "tmp"
OPTIMUM_VENV = ROOT / "bench" / ".venv-optimum"
PY = sys.executable
MAX_SEQ_LEN = 512


def machine() -> dict:
    import psutil

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "os": platform.platform(), "python": platform.python_version()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def lowerbench_export_cmd(hf: Path, out: Path, export_only: bool = True) -> list[str]:
    """The same checkpoint folder optimum reads. export_only: what optimum-cli does (checkpoint -> .pte);
    without it Lowerbench also generates with the fp32 reference and the .pte and measures fidelity."""
    return [PY, "-m", "recipes", "run", "--model", str(hf), "--recipe", RECIPE, *PEER_ALGORITHM,
            "--max-seq-len", str(MAX_SEQ_LEN), *(["--export-only"] if export_only else []), "--out", str(out)]


def optimum_export_cmd(hf: Path, out: Path, max_seq_len: int = MAX_SEQ_LEN) -> list[str]:
    return [str(OPTIMUM_VENV / "bin" / "optimum-cli"), "export", "executorch", "--model", str(hf),
            "--task", "text-generation", "--recipe", "xnnpack", "--qlinear", "8da4w", "--qlinear_group_size", "32",
            "--qembedding", "8w",
            "--use_custom_sdpa", "--use_custom_kv_cache", "--max_seq_len", str(max_seq_len), "--output_dir", str(out)]


def optimum_available() -> str | None:
    """None when optimum-cli is installed, else why not."""
    if not (OPTIMUM_VENV / "bin" / "optimum-cli").is_file():
        return f"{OPTIMUM_VENV} has no optimum-cli; run `bash bench/setup.sh`"
    return None


def optimum_pte(hf: Path, log_dir: Path) -> tuple[Path | None, str | None]:
    """(the optimum .pte for a decode comparison, or None and why not): the one the export phase made, or a
    fresh export."""
    found = sorted(TMP.glob("optimum-export-*/model.pte"))
    if found:
        return found[0], None
    why_not = optimum_available()
    if why_not:
        return None, why_not
    out = TMP / "optimum-export-0"
    record = run_measured(optimum_export_cmd(hf, out), log_dir / "optimum-export-0.log", cwd=ROOT)
    if record["returncode"] != 0:
        return None, "optimum export failed (see bench/results/tmp/logs)"
    return out / "model.pte", None


def lowerbench_pte(hf: Path, log_dir: Path) -> Path | None:
    found = sorted(TMP.glob("lowerbench-export-*/model.pte")) + sorted(TMP.glob("lowerbench-pte/model.pte"))
    if found:
        return found[0]
    out = TMP / "lowerbench-pte"
    record = run_measured(lowerbench_export_cmd(hf, out), log_dir / "lowerbench-pte.log", cwd=ROOT)
    return out / "model.pte" if record["returncode"] == 0 else None


def phase_decode(args, hf: Path) -> dict:
    log_dir = TMP / "logs"
    engines: dict[str, list[str] | None] = {}
    skipped = {}
    wanted = lambda name: name not in args.skip and (not args.peers or name in args.peers)
    pte = lowerbench_pte(hf, log_dir) if wanted("lowerbench-pte") else None
    common_for = lambda threads: ["--hf", str(hf), "--new-tokens", str(args.new_tokens), "--threads", str(threads)]
    common = common_for(args.threads)
    lowerbench_cmd = [PY, "-m", "bench.decode", "lowerbench-pte", "--pte", str(pte)]
    engines["lowerbench-pte"] = [*lowerbench_cmd, *common] if pte else None
    if pte is None and wanted("lowerbench-pte"):
        skipped["lowerbench-pte"] = "the Lowerbench export failed (see bench/results/tmp/logs)"
    if importlib.util.find_spec("llama_cpp") is not None:
        engines["llama.cpp"] = [PY, "-m", "bench.decode", "llama.cpp", "--gguf", str(builtin_gguf()), *common]
    else:
        skipped["llama.cpp"] = "llama-cpp-python is not installed; run `bash bench/setup.sh`"
    engines["hf-eager"] = [PY, "-m", "bench.decode", "hf-eager", *common]
    if wanted("optimum-pte"):
        opte, why_not = optimum_pte(hf, log_dir)
        if opte is not None:
            engines["optimum-pte"] = [PY, "-m", "bench.decode", "optimum-pte", "--pte", str(opte), *common]
        else:
            skipped["optimum-pte"] = why_not
    for name in list(engines):
        if name in args.skip or (args.peers and name not in args.peers):
            engines.pop(name)
    if args.threads > 1 and engines.get("lowerbench-pte"):
        # The same .pte on one thread: how much a second core buys. Not optimum's .pte: on one thread it
        # aborts in executorch.runtime ("double free or corruption").
        engines[table.ONE_THREAD_PROBE] = [*lowerbench_cmd, *common_for(1)]
    if engines.get("lowerbench-pte"):
        # The same .pte without Lowerbench's thread policy (recipes/process/thread_policy.py): what the policy buys.
        engines[table.STOCK_THREADS_PROBE] = [*lowerbench_cmd, *common, "--stock-threads"]
    if engines:
        # The memory-bound ceiling, measured in turn with the engines so it sees the same machine state.
        engines[table.MEMORY_READ] = [PY, "-m", "bench.memory", "--threads", str(args.threads)]
    for name in args.skip:
        skipped.setdefault(name, "skipped with --skip")
    runs = run_interleaved("decode", {name: cmd for name, cmd in engines.items() if cmd}, args.runs, log_dir)
    return {"skipped": skipped, "runs": runs,
            "settings": {"new_tokens": args.new_tokens, "threads": args.threads, "max_seq_len": MAX_SEQ_LEN,
                         "greedy": True, "eos_ignored": True,
                         "decode_weight_mb_per_token": round(decode_weight_bytes_per_token(hf) / 1e6, 2)}}


def run_interleaved(phase: str, engines: dict[str, list[str]], runs: int, log_dir: Path) -> list[dict]:
    """Every engine once per run, in turn (A B A B ...), each in its own process."""
    records = []
    for i in range(runs):
        for name, cmd in engines.items():
            record = run_measured(cmd, log_dir / f"{phase}-{name}-{i}.log", cwd=ROOT)
            record.update(engine=name, run=i)
            records.append(record)
            result = record["result"] or {}
            figure = (f"{result.get('read_gb_per_s')} GB/s" if name == table.MEMORY_READ
                      else f"{result.get('decode_tokens_per_s')} tok/s")
            _progress(f"{phase} {name} run {i}: {figure}")
    return records


def phase_runner(args, hf: Path) -> dict:
    """ExecuTorch's LLM runner on Lowerbench's and optimum's xnnpack 8da4w .pte, and the Python step loop
    (bench/decode.py) on the same two files: same prompt, token count and threads, interleaved run by run.
    The runner loads Lowerbench's tokenizer.json for both: optimum-cli writes none."""
    log_dir = TMP / "logs"
    common = ["--hf", str(hf), "--prompt", LONG_ANSWER_PROMPT, "--new-tokens", str(args.new_tokens),
              "--threads", str(args.threads)]
    skipped, programs = {}, {}
    pte = lowerbench_pte(hf, log_dir)
    tokenizer_json = pte.parent / "tokenizer.json" if pte else None
    if pte is None or not tokenizer_json.is_file():
        skipped["lowerbench-pte"] = "no Lowerbench .pte with its tokenizer.json (see bench/results/tmp/logs)"
        return {"skipped": skipped, "runs": [], "settings": {"ratios": []}}
    programs["lowerbench-pte"] = pte
    opte, why_not = optimum_pte(hf, log_dir) if "optimum-pte" not in args.skip else (None, "skipped with --skip")
    if opte is not None:
        programs["optimum-pte"] = opte
    else:
        skipped["optimum-pte"] = why_not
    engines = {}
    for program, path in programs.items():
        engines[f"{program} · {table.RUNNER}"] = [PY, "-m", "bench.runner", "--pte", str(path),
                                                   "--tokenizer-json", str(tokenizer_json), *common]
        engines[f"{program} · {table.STEP_LOOP}"] = [PY, "-m", "bench.decode", program, "--pte", str(path), *common]
    ratios = [("Lowerbench ÷ optimum, both in the LLM runner", f"lowerbench-pte · {table.RUNNER}",
               f"optimum-pte · {table.RUNNER}"),
              ("Lowerbench ÷ optimum, both in the Python step loop", f"lowerbench-pte · {table.STEP_LOOP}",
               f"optimum-pte · {table.STEP_LOOP}"),
              *((f"LLM runner ÷ Python step loop, {p}", f"{p} · {table.RUNNER}", f"{p} · {table.STEP_LOOP}")
                for p in programs)]
    runs = run_interleaved("runner", engines, args.runs, log_dir)
    return {"skipped": skipped, "runs": runs,
            "settings": {"prompt": LONG_ANSWER_PROMPT, "new_tokens": args.new_tokens, "threads": args.threads,
                         "max_seq_len": MAX_SEQ_LEN, "greedy": True, "programs": {k: str(v) for k, v in programs.items()},
                         "tokenizer_json": str(tokenizer_json), "versions": versions(), "ratios": ratios}}


def versions() -> dict:
    from importlib.metadata import version

    found = {name: version(name) for name in ("executorch", "torch", "torchao", "transformers")}
    optimum_python = OPTIMUM_VENV / "bin" / "python"
    if optimum_python.exists():
        import subprocess

        out = subprocess.run([str(optimum_python), "-c", "from importlib.metadata import version as v; "
                              "print(v('optimum-executorch'), v('executorch'), v('torch'))"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            opt, et, torch = out.stdout.split()
            found["optimum_export"] = {"optimum-executorch": opt, "executorch": et, "torch": torch}
    return found


def summarize_decode(data: dict) -> dict:
    summary = {}
    for name in dict.fromkeys(r["engine"] for r in data["runs"]):
        ok = [r["result"] for r in data["runs"] if r["engine"] == name and r["returncode"] == 0 and r["result"]]
        if name == table.MEMORY_READ:
            summary[name] = {"runs": len(ok), "read_gb_per_s": median([r["read_gb_per_s"] for r in ok])}
            continue
        summary[name] = {
            "runs": len(ok),
            "prefill_tokens_per_s": median([r["prefill_tokens_per_s"] for r in ok]),
            "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in ok]),
            "prefill_tokens_per_cpu_s": median([r.get("prefill_tokens_per_cpu_s") for r in ok]),
            "decode_tokens_per_cpu_s": median([r.get("decode_tokens_per_cpu_s") for r in ok]),
            "prompt_tokens": ok[0]["prompt_tokens"] if ok else None,
            "new_tokens": ok[0]["new_tokens"] if ok else None,
            "text": ok[0]["text"] if ok else None,
        }
    return {"engines": summary}


def phase_export(args, hf: Path) -> dict:
    log_dir = TMP / "logs"
    peers = {"lowerbench": lambda i: lowerbench_export_cmd(hf, TMP / f"lowerbench-export-{i}")}
    if "lowerbench-full" in args.peers:
        # Only on request: the whole Lowerbench job, with its generations and fidelity, is not what optimum does.
        peers["lowerbench-full"] = lambda i: lowerbench_export_cmd(hf, TMP / f"lowerbench-full-{i}", export_only=False)
    skipped = {}
    why_not = optimum_available()
    if why_not or "optimum" in args.skip:
        skipped["optimum"] = why_not or "skipped with --skip"
    else:
        peers["optimum"] = lambda i: optimum_export_cmd(hf, TMP / f"optimum-export-{i}")
    peers = {k: v for k, v in peers.items() if not args.peers or k in args.peers}
    runs = []
    for i in range(args.runs):
        for name, cmd in peers.items():
            out = Path(cmd(i)[-1])
            shutil.rmtree(out, ignore_errors=True)
            record = run_measured(cmd(i), log_dir / f"export-{name}-{i}.log", cwd=ROOT,
                                  timeout_s=args.export_timeout)
            record.update(peer=name, run=i, timeout_s=args.export_timeout)
            if name.startswith("lowerbench"):
                report = out / "report.json"
                record["timings_s"] = load_report(report).timings.to_dict() if report.is_file() else None
            pte = next(iter(sorted(out.glob("*.pte"))), None)
            record["pte_bytes"] = pte.stat().st_size if pte else None
            runs.append(record)
            _progress(f"export {name} run {i}: {record['wall_s']} s, {record['peak_rss_mb']} MB, rc {record['returncode']}")
    return {"skipped": skipped, "runs": runs, "settings": {"max_seq_len": MAX_SEQ_LEN}}


def summarize_export(data: dict) -> dict:
    summary = {}
    for name in dict.fromkeys(r["peer"] for r in data["runs"]):
        mine = [r for r in data["runs"] if r["peer"] == name]
        ok = [r for r in mine if r["returncode"] == 0]
        row = {"runs": len(ok), "failed_runs": [{"wall_s": r["wall_s"], "cpu_s": r.get("cpu_s"), "returncode": r["returncode"],
                                                "peak_rss_mb": r["peak_rss_mb"],
                                                "killed_after_s": r.get("timeout_s")} for r in mine if r["returncode"] != 0],
               "wall_s": median([r["wall_s"] for r in ok]),
               "peak_rss_mb": median([r["peak_rss_mb"] for r in ok]), "cpu_s": median([r["cpu_s"] for r in ok]),
               "pte_mb": median([r["pte_bytes"] / 1e6 for r in ok if r["pte_bytes"]])}
        stages = [r["timings_s"] for r in ok if r.get("timings_s")]
        if stages:
            keys = ("load", "reference_generation", "quantize", "export", "lower", "serialize", "generate")
            row["stages_s"] = {k: median([s.get(k) for s in stages]) for k in keys}
            row["export_path_s"] = median([sum(s.get(k) or 0 for k in ("load", "quantize", "export", "lower", "serialize"))
                                           for s in stages])
        summary[name] = row
    return {"peers": summary}


KV_CONTEXT = 8192  # the built-in model's own max_position_embeddings


def kv_results_name(shape: str) -> str:
    """The kv phase's results file (without .json): kv for the built-in model, kv-<shape> for another shape."""
    return "kv" if shape == kv.BUILTIN_SHAPE else f"kv-{shape}"


def phase_kv(args, hf: Path) -> dict:
    """xnnpack-8da4w at a context of KV_CONTEXT with fp32 and int8 caches (optimum's HQQ qparams, as the other
    peer comparisons), and optimum's .pte of the same context, in ExecuTorch's LLM runner at each position of
    bench/kv.py, programs in turn within each run; and the runner's process without a program (its RSS floor).
    The built-in model, or --kv-shape's random checkpoint (bench/scale_models.py, under --scale-dir)."""
    log_dir = TMP / "logs"
    suffix = kv_results_name(args.kv_shape).removeprefix("kv")
    if args.kv_shape != kv.BUILTIN_SHAPE:
        hf = scale.checkpoint_folder(args.kv_shape, Path(args.scale_dir))
    programs, skipped, exports = {}, {}, []
    for name, cache in zip(kv.PROGRAMS, ("fp32", "int8")):
        out = TMP / f"kv-{cache}{suffix}"
        if not (out / "model.pte").is_file():
            cmd = [PY, "-m", "recipes", "run", "--model", str(hf), "--recipe", RECIPE, *PEER_ALGORITHM, "--kv-cache",
                   cache, "--max-seq-len", str(KV_CONTEXT), "--export-only", "--no-profile", "--out", str(out)]
            record = run_measured(cmd, log_dir / f"kv-export-{cache}{suffix}.log", cwd=ROOT,
                                  timeout_s=args.export_timeout)
            exports.append({"program": name, "returncode": record["returncode"], "wall_s": record["wall_s"],
                            "peak_rss_mb": record["peak_rss_mb"]})
            _progress(f"kv export {name}: rc {record['returncode']}, {record['wall_s']} s")
        if (out / "model.pte").is_file():
            programs[name] = out / "model.pte"
        else:
            skipped[name] = "the export failed (see bench/results/tmp/logs)"
    tokenizer_json = next((p.parent / "tokenizer.json" for p in programs.values()), None)
    why_not = optimum_available() or ("skipped with --skip" if kv.OPTIMUM in args.skip else None)
    if why_not is None:
        out = TMP / f"optimum-export-{KV_CONTEXT}{suffix}"
        if not (out / "model.pte").is_file():
            record = run_measured(optimum_export_cmd(hf, out, KV_CONTEXT), log_dir / f"kv-export-optimum{suffix}.log",
                                  cwd=ROOT, timeout_s=args.export_timeout)
            exports.append({"program": kv.OPTIMUM, "returncode": record["returncode"], "wall_s": record["wall_s"],
                            "peak_rss_mb": record["peak_rss_mb"]})
            _progress(f"kv export {kv.OPTIMUM}: rc {record['returncode']}, {record['wall_s']} s")
        if (out / "model.pte").is_file():
            programs[kv.OPTIMUM] = out / "model.pte"
        else:
            why_not = "optimum-cli export failed (see bench/results/tmp/logs)"
    if why_not:
        skipped[kv.OPTIMUM] = why_not
    engines = {}
    if tokenizer_json is not None:
        for position in kv.POSITIONS:
            for name, pte in programs.items():
                engines[f"{name} @ {position}"] = [PY, "-m", "bench.kv", "run", "--pte", str(pte), "--tokenizer-json",
                                                   str(tokenizer_json), "--hf", str(hf), "--position", str(position),
                                                   "--new-tokens", str(kv.NEW_TOKENS), "--threads", str(args.threads)]
        engines[kv.FLOOR] = [PY, "-m", "bench.kv", "floor"]
        for cache in ("fp32", "int8"):
            engines[f"{kv.ATTENTION} ({cache})"] = [PY, "-m", "bench.kv", "attention", "--hf", str(hf), "--cache", cache,
                                                   "--context", str(KV_CONTEXT), "--threads", str(args.threads)]
    if args.peers:  # only these engines; the phase's other runs stay in kv.json (save_phase)
        engines = {name: cmd for name, cmd in engines.items() if name in args.peers}
    runs = run_interleaved(kv_results_name(args.kv_shape), engines, args.runs, log_dir)
    return {"skipped": skipped, "runs": runs, "exports": exports,
            "settings": {"shape": args.kv_shape, "context": KV_CONTEXT, "positions": list(kv.POSITIONS), "new_tokens": kv.NEW_TOKENS,
                         "threads": args.threads, "recipe": RECIPE, "quant_algorithm": PEER_ALGORITHM[1],
                         "greedy": True, "programs": {k: str(v) for k, v in programs.items()},
                         "tokenizer_json": str(tokenizer_json), "versions": versions()}}


def summarize_kv(data: dict) -> dict:
    return kv.summarize_kv(data)


def _progress(message: str) -> None:
    print(f"[bench {dt.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def phase_scale(args, hf: Path) -> dict:
    return scale.phase_scale(args, TMP, PY, ROOT, optimum_export_cmd, optimum_available(), _progress)


def summarize_scale(data: dict) -> dict:
    return scale.summarize_scale(data)


def phase_versions(args, hf: Path) -> dict:
    return versions_phase.phase_versions(args, TMP, PY, ROOT, _progress)


def summarize_versions(data: dict) -> dict:
    return versions_phase.summarize_versions(data)


def phase_front(args, hf: Path) -> dict:
    def save(partial: dict) -> None:
        meta = {**args.phase_meta, "load_average_after": load_average()}
        save_phase("front", meta, json.loads(json.dumps(partial)))

    return front.phase_front(args, hf, TMP, PY, ROOT, run_interleaved, _progress, save)


def summarize_front(data: dict) -> dict:
    return front.summarize_front(data)


PHASES = {"decode": (phase_decode, summarize_decode, "engine"), "runner": (phase_runner, summarize_runner, "engine"), "export": (phase_export, summarize_export, "peer"),
          "scale": (phase_scale, summarize_scale, "peer"),
          "versions": (phase_versions, summarize_versions, "install"),
          "front": (phase_front, summarize_front, "shape"),
          "kv": (phase_kv, summarize_kv, "engine")}


def keep_other_shapes(old: dict, meta: dict, result: dict) -> None:
    """The scale phase fills in shape by shape, and with --peers peer by peer: the runs this invocation did not
    measure stay (other shapes' runs, and with --peers the other peers' runs of its shapes)."""
    measured, peers = set(result["settings"]["shapes"]), set(meta.get("peers") or [])
    stays = lambda r, peer: r["shape"] not in measured or bool(peers and peer not in peers)
    kept = {"runs": [r for r in old.get("runs", []) if stays(r, r["peer"])],
            "decode": [r for r in old.get("decode", []) if stays(r, scale.peer_of_engine(r["engine"]))]}
    if kept["runs"] or kept["decode"]:
        result["runs"] = kept["runs"] + result["runs"]
        result["decode"] = kept["decode"] + result["decode"]
        ran = {f"{r['shape']} {r['peer']}" for r in result["runs"]}
        result["skipped"] = {k: v for k, v in {**{k: v for k, v in old.get("skipped", {}).items()
                                                  if k.split()[0] not in measured}, **result["skipped"]}.items()
                             if k not in ran}
        result["settings"]["shapes"] = list(dict.fromkeys([r["shape"] for r in result["runs"]] + list(measured)))
        meta["earlier_meta"] = old["meta"]


def save_phase(name: str, meta: dict, result: dict, file_name: str | None = None) -> None:
    """With --peers, runs of the other peers already in <phase>.json (or <file_name>.json) are kept, so a phase
    can be filled in piece by piece (each run record keeps its own time and load average)."""
    _run, summarize, key = PHASES[name]
    path = RESULTS / f"{file_name or name}.json"
    if meta["peers"] and path.is_file() and name not in ("scale", "front"):
        old = json.loads(path.read_text())
        kept = [r for r in old["runs"] if str(r[key]) not in meta["peers"]]
        result["runs"] = kept + result["runs"]
        result["skipped"] = {**old.get("skipped", {}), **result.get("skipped", {})}
        for peer in {str(r[key]) for r in result["runs"]}:
            result["skipped"].pop(peer, None)
        meta["earlier_meta"] = old["meta"]
    if name == "scale" and path.is_file():
        keep_other_shapes(json.loads(path.read_text()), meta, result)
    if name == "front" and path.is_file():
        front.keep_unmeasured(json.loads(path.read_text()), meta, result)
    data = {"meta": meta, **result}
    data.update(summarize(data))
    path.write_text(json.dumps(data, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median); default 3")
    parser.add_argument("--phases", default="decode,export")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", default="", help="peers to leave out, e.g. optimum-pte,optimum")
    parser.add_argument("--peers", default="", help="only these peers (e.g. llama.cpp,hf-eager or optimum); "
                        "other peers' runs already in the phase's JSON are kept")
    parser.add_argument("--export-timeout", type=float, default=3600, help="seconds before an export is killed")
    parser.add_argument("--note", default="", help="a caveat printed with the tables (e.g. a shared CPU)")
    parser.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b,tinyllama-1.1b,llama-3.2-3b",
                        help="scale phase: model shapes (bench/scale_models.py)")
    parser.add_argument("--scale-recipes", default="xnnpack-8da4w", help="scale phase: export-only recipes")
    parser.add_argument("--scale-algorithms", default="hqq",
                        help="scale phase: the int4 algorithms xnnpack-8da4w is exported with, in turn; `default` "
                             "is Lowerbench's own (hqq: optimum-cli's qparams, the same work)")
    parser.add_argument("--scale-full", action="store_true", help="scale phase: also the full xnnpack-8da4w job")
    parser.add_argument("--scale-dir", default=str(ROOT / "bench" / ".cache" / "scale"),
                        help="scale phase: where the random checkpoints are written (several GB each)")
    parser.add_argument("--baseline-python", default="", help="versions phase: the interpreter of the install "
                        "to compare against (e.g. a venv with the previous executorch pin)")
    parser.add_argument("--baseline-root", default="", help="versions phase: that install's Lowerbench checkout")
    parser.add_argument("--versions-shapes", default="smollm2-135m,llama-3.2-1b",
                        help="versions phase: the shapes both installs export (bench/scale_models.py)")
    parser.add_argument("--versions-decode", default="smollm2-135m",
                        help="versions phase: the shapes whose .pte each install also decodes")
    parser.add_argument("--scale-memory-gb", type=float, default=12.0,
                        help="scale phase: shapes whose export-only estimate is higher are not run")
    parser.add_argument("--kv-shape", default=kv.BUILTIN_SHAPE,
                        help="kv phase: the built-in model, or a shape of bench/scale_models.py (random weights, "
                        "checkpoint under --scale-dir; results in kv-<shape>.json)")
    parser.add_argument("--front-shapes", default="smollm2-135m,llama-3.2-1b",
                        help="front phase: the built-in model (full jobs) and shapes of bench/scale_models.py "
                        "(export-only, random weights; checkpoints under --scale-dir)")
    parser.add_argument("--front-groups", default="32,128,64,256",
                        help="front phase: group sizes to try, in this order; those that do not divide a "
                        "model's widths are left out")
    parser.add_argument("--front-algorithms", default=",".join(front_algorithms),
                        help="front phase: the weight algorithms of the built-in model's jobs")
    parser.add_argument("--front-mixed", default=",".join(front_mixed),
                        help="front phase: the algorithms that also get a job with the most sensitive linears at "
                        "8 bits (group 32, +15 %% bytes per token); empty for none")
    parser.add_argument("--front-retime", action="store_true",
                        help="front phase: also time the built-in programs the last front run left on disk (with "
                        "--front-algorithms '' to time them only)")
    args = parser.parse_args()
    args.front_algorithms = [x for x in args.front_algorithms.split(",") if x]
    args.front_mixed = [x for x in args.front_mixed.split(",") if x]
    args.skip = [x for x in args.skip.split(",") if x]
    args.peers = [x for x in args.peers.split(",") if x]
    RESULTS.mkdir(parents=True, exist_ok=True)
    hf = hf_folder()
    for name in [p for p in args.phases.split(",") if p]:
        meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                "runs_requested": args.runs, "load_average_before": load_average(), "note": args.note,
                "peers": args.peers}
        _progress(f"phase {name}")
        args.phase_meta = meta  # a phase that saves as it goes (front) saves under the same meta
        result = PHASES[name][0](args, hf)
        meta["load_average_after"] = load_average()
        save_phase(name, meta, result, kv_results_name(args.kv_shape) if name == "kv" else None)
        table.write_all(RESULTS)
    print((RESULTS / "README.md").read_text())


if __name__ == "__main__":
    main()
