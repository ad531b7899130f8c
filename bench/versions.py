"""Phase `versions`: this Lowerbench against another install of it (a checkout and its Python, e.g. the previous
ExecuTorch pin), in one run, A B A B: the export phase's command (export-only xnnpack-8da4w) on the built-in
model and on the scale phase's shapes, with wall time, peak RSS and the .pte's size, then each install decoding
its own .pte on its own ExecuTorch runtime (bench/decode.py). Ratios are this install ÷ the baseline, paired
within each run."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from bench.measure import median, paired_ratio_by_run, run_measured
from bench.scale import RECIPE, checkpoint_folder, lowerbench_cmd
from recipes.output.report import load_report

MAX_SEQ_LEN = 512
CURRENT, BASELINE = "current", "baseline"


def stack_of(python: str, root: Path) -> dict:
    """The versions an install runs on and the commit of its checkout."""
    out = subprocess.run([python, "-c", "from importlib.metadata import version as v; "
                          "print(v('executorch'), v('torch'), v('torchao'))"], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot import the packages Lowerbench needs: {out.stderr.strip()[-500:]}")
    executorch, torch, torchao = out.stdout.split()
    commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return {"python": python, "root": str(root), "commit": commit.stdout.strip() or None,
            "executorch": executorch, "torch": torch, "torchao": torchao}


def phase_versions(args, tmp: Path, py: str, root: Path, progress) -> dict:
    if not args.baseline_python or not args.baseline_root:
        raise SystemExit("the versions phase needs --baseline-python and --baseline-root (another Lowerbench "
                         "checkout and the interpreter that has its packages)")
    installs = {CURRENT: (py, root), BASELINE: (args.baseline_python, Path(args.baseline_root).resolve())}
    stacks = {name: stack_of(python, where) for name, (python, where) in installs.items()}
    shapes = [s for s in args.versions_shapes.split(",") if s]
    exports, decodes = [], []
    for shape in shapes:
        folder = checkpoint_folder(shape, Path(args.scale_dir))
        for i in range(args.runs):
            for name, (python, where) in installs.items():
                out = tmp / f"versions-{shape}-{name}-{i}"
                shutil.rmtree(out, ignore_errors=True)
                record = run_measured(lowerbench_cmd(python, folder, out, RECIPE, MAX_SEQ_LEN, full=False),
                                      tmp / "logs" / f"versions-{shape}-{name}-{i}.log", cwd=where,
                                      timeout_s=args.export_timeout)
                report = out / "report.json"
                pte = out / "model.pte"
                memory = load_report(report).memory if report.is_file() else None
                stage_peaks = memory.peak_rss_mb_by_stage if memory else None
                record.update(shape=shape, install=name, run=i, stage_peak_rss_mb=stage_peaks,
                              pte_bytes=pte.stat().st_size if pte.is_file() else None)
                exports.append(record)
                progress(f"versions export {shape} {name} run {i}: {record['wall_s']} s, {record['peak_rss_mb']} MB")
                if record["returncode"] == 0 and shape in args.versions_decode.split(","):
                    decode = run_measured([python, "-m", "bench.decode", "lowerbench-pte", "--pte", str(pte),
                                           "--hf", str(folder), "--new-tokens", str(args.new_tokens),
                                           "--threads", str(args.threads)],
                                          tmp / "logs" / f"versions-decode-{shape}-{name}-{i}.log", cwd=where)
                    decode.update(shape=shape, install=name, run=i)
                    decodes.append(decode)
                    progress(f"versions decode {shape} {name} run {i}: "
                             f"{(decode['result'] or {}).get('decode_tokens_per_s')} tok/s")
                shutil.rmtree(out, ignore_errors=True)
    return {"skipped": {}, "exports": exports, "decodes": decodes,
            "settings": {"recipe": RECIPE, "max_seq_len": MAX_SEQ_LEN, "new_tokens": args.new_tokens,
                         "threads": args.threads, "installs": stacks}}


def _paired(records: list[dict], value) -> float | None:
    """Median over runs of current ÷ baseline, each run's pair measured back to back."""
    ok = [r for r in records if r["returncode"] == 0]
    return paired_ratio_by_run(ok, CURRENT, BASELINE, lambda r: r["install"], value)


def summarize_versions(data: dict) -> dict:
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in data["exports"]):
        exports = [r for r in data["exports"] if r["shape"] == shape]
        decodes = [r for r in data["decodes"] if r["shape"] == shape]
        row = {"shape": shape}
        for name in (CURRENT, BASELINE):
            ok = [r for r in exports if r["install"] == name and r["returncode"] == 0]
            dec = [r["result"] for r in decodes if r["install"] == name and r["returncode"] == 0 and r["result"]]
            row[name] = {"runs": len(ok), "failed_runs": sum(r["install"] == name and r["returncode"] != 0 for r in exports),
                         "wall_s": median([r["wall_s"] for r in ok]), "peak_rss_mb": median([r["peak_rss_mb"] for r in ok]),
                         "pte_mb": median([r["pte_bytes"] / 1e6 for r in ok if r["pte_bytes"]]),
                         "decode_tokens_per_s": median([d["decode_tokens_per_s"] for d in dec]),
                         "prefill_tokens_per_s": median([d["prefill_tokens_per_s"] for d in dec]),
                         "text": dec[0]["text"] if dec else None}
        row["current_over_baseline"] = {
            "wall": _paired(exports, lambda r: r["wall_s"]),
            "peak_rss": _paired(exports, lambda r: r["peak_rss_mb"]),
            "pte": _paired(exports, lambda r: r["pte_bytes"]),
            "decode": _paired(decodes, lambda r: (r["result"] or {}).get("decode_tokens_per_s")),
            "prefill": _paired(decodes, lambda r: (r["result"] or {}).get("prefill_tokens_per_s")),
        }
        rows.append(row)
    return {"shapes": rows}
