"""Run one command as a child process; wall time and peak RSS of its whole process tree
(sum of RSS over the tree, polled, each address space counted once), plus what the child printed as its last
JSON line. And the median over runs that every figure of the benchmark is."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import statistics
import subprocess
import time
from pathlib import Path

import psutil

POLL_S = 0.1


_SYS_KCMP = 312 if platform.machine() == "x86_64" else None  # its number differs per architecture
_KCMP_VM = 1
_libc = ctypes.CDLL(None, use_errno=True)


def same_address_space(pid_a: int, pid_b: int) -> bool:
    """True when two processes share one address space (kcmp(2), KCMP_VM). A child made by vfork shares its
    parent's until it calls exec, and /proc shows it with the parent's whole RSS. ExecuTorch's XNNPACK
    preprocessing runs `flatc` once per partition (Python's subprocess uses vfork), so a poll that landed in
    that window counted the exporting process twice. False where
    kcmp is unavailable, which is the old sum."""
    return _SYS_KCMP is not None and _libc.syscall(_SYS_KCMP, pid_a, pid_b, _KCMP_VM, 0, 0) == 0


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    counted: list[int] = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            if any(same_address_space(p.pid, other) for other in counted):
                continue
            total += p.memory_info().rss
            counted.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run_measured(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None,
                 timeout_s: float | None = None) -> dict:
    """{cmd, returncode, wall_s, peak_rss_mb, cpu_s, result (the last stdout line that parses as JSON)}."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "wb") as out:
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, env=full_env, cwd=cwd)
        watched = psutil.Process(child.pid)
        peak = 0
        stdout_chunks = []
        import threading

        reader = threading.Thread(target=lambda: stdout_chunks.append(child.stdout.read()), daemon=True)
        reader.start()
        while child.poll() is None:
            peak = max(peak, tree_rss(watched))
            if timeout_s is not None and time.perf_counter() - started > timeout_s:
                for p in [*watched.children(recursive=True), watched]:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                break
            time.sleep(POLL_S)
        child.wait()
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        reader.join()
    stdout = b"".join(stdout_chunks).decode(errors="replace")
    with open(log, "ab") as out:
        out.write(b"\n--- stdout ---\n" + stdout.encode())
    result = None
    for line in reversed(stdout.splitlines()):
        try:
            result = json.loads(line)
            break
        except json.JSONDecodeError:
            continue
    return {"cmd": cmd, "returncode": child.returncode, "wall_s": round(wall, 2),
            "peak_rss_mb": round(peak / 2**20, 1),
            # CPU seconds of the waited-for tree: less distorted than wall time when other jobs share the CPU
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2), "result": result, "log": str(log)}


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def paired_ratio_by_run(records, numerator: str, denominator: str, side, value) -> float | None:
    """Median over run indices of value(numerator's record) ÷ value(denominator's), `side` naming each
    record's side: each pair ran back to back, so a slow spell of a shared machine hits both sides alike.
    Records without a value (a failed run) leave their pair out."""
    by_run: dict[int, dict[str, float]] = {}
    for r in records:
        v = value(r)
        if v:
            by_run.setdefault(r.get("run", 0), {})[side(r)] = v
    return median(v[numerator] / v[denominator] for v in by_run.values() if numerator in v and denominator in v)
