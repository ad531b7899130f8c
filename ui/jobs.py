"""Jobs in their own folders and processes, for a server that runs them for many people (the app).

Each job gets a fresh folder under the jobs root and runs `recipes.pipeline.run.run` in a fresh process: torch.export is
not thread-safe, and a crash must not take the server down. Old folders are deleted, the folder stays under a
disk cap, and a cancelled job is killed if it does not reach a stage boundary soon.

Environment: LOWERBENCH_JOBS_DIR (default ./jobs), LOWERBENCH_JOB_MAX_AGE_H (job folders older than this are
deleted, default 6), LOWERBENCH_JOBS_MAX_GB (the oldest finished jobs are deleted to keep the jobs folder under
this size, default 20).
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import shutil
import threading
import time
import traceback
import uuid
from contextlib import contextmanager
from pathlib import Path

from models.errors import UserFacingError
from recipes.process.dependency_noise import silence_dependency_noise
from recipes.process.runtime_log import LOG_NAME, runtime_log_to
from recipes.output.report import JobSummary

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def jobs_root() -> Path:
    return Path(os.environ.get("LOWERBENCH_JOBS_DIR", PROJECT_ROOT / "jobs")).resolve()


def clean_old_jobs(root: Path, max_age_s: float) -> None:
    if not root.is_dir():
        return
    now = time.time()
    for job in root.iterdir():
        if job.is_dir() and now - job.stat().st_mtime > max_age_s:
            shutil.rmtree(job, ignore_errors=True)


ACTIVE_JOBS: set[Path] = set()  # job folders of this server that are still running; never removed by the cap


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def enforce_disk_cap(root: Path, max_bytes: float) -> None:
    """Deletes the oldest finished jobs until the jobs folder is under the cap; refuses a new job when the
    running ones alone are over it."""
    if not root.is_dir():
        return
    jobs = sorted((j for j in root.iterdir() if j.is_dir()), key=lambda j: j.stat().st_mtime)
    sizes = {job: folder_bytes(job) for job in jobs}
    total = sum(sizes.values())
    for job in jobs:
        if total <= max_bytes:
            break
        if job not in ACTIVE_JOBS:
            shutil.rmtree(job, ignore_errors=True)
            total -= sizes[job]
    if total > max_bytes:
        raise UserFacingError(
            f"running jobs use {total / 1e9:.1f} GB, above the jobs folder cap of {max_bytes / 1e9:.1f} GB "
            "(LOWERBENCH_JOBS_MAX_GB); try again when one of them has finished."
        )


def new_job_dir() -> Path:
    root = jobs_root()
    clean_old_jobs(root, float(os.environ.get("LOWERBENCH_JOB_MAX_AGE_H", "6")) * 3600)
    enforce_disk_cap(root, float(os.environ.get("LOWERBENCH_JOBS_MAX_GB", "20")) * 1e9)
    job = root / uuid.uuid4().hex
    job.mkdir(parents=True)
    ACTIVE_JOBS.add(job)
    return job


def _job_process(pickled_request: bytes, messages, cancel_flag) -> None:
    """Runs in the job's own process: run() with progress sent back and the UI's cancel relayed."""
    silence_dependency_noise()
    request = pickle.loads(pickled_request)  # after the line above: the request's module imports torchao, which logs
    from recipes.pipeline.run import run  # loads torch: app.py imports this module before its thread policy is set

    cancel = threading.Event()
    threading.Thread(target=lambda: (cancel_flag.wait(), cancel.set()), daemon=True).start()
    try:
        with runtime_log_to(Path(request.out_dir) / LOG_NAME):  # ExecuTorch's C++ log into the job's folder
            summary = run(request, progress=lambda f, m: messages.put(("progress", f, m)), cancel=cancel)
        messages.put(("done", summary))
    except UserFacingError as err:
        messages.put(("error", str(err)))
    except BaseException as err:  # the UI gets one line; the server log gets the traceback
        traceback.print_exc()
        messages.put(("error", f"internal error ({type(err).__name__}); the server log has the details."))


_CANCELS: dict[str, object] = {}  # session -> cancel flag of its running job
CANCEL_GRACE_S = 3.0  # how long a cancelled job may take to reach a stage boundary before it is killed
_CANCELS_LOCK = threading.Lock()


def run_job(request, session: str, progress) -> JobSummary:
    """run() in a fresh process; raises UserFacingError with run()'s message when it fails. The summary comes back
    pickled through a queue, so everything in it is plain data (recipes/output/report.py)."""
    context = multiprocessing.get_context("spawn")
    messages, cancel_flag = context.Queue(), context.Event()
    with _CANCELS_LOCK:
        _CANCELS[session] = cancel_flag
    process = context.Process(target=_job_process, args=(pickle.dumps(request), messages, cancel_flag), daemon=True)
    try:
        progress(0.0, "starting the job")
        process.start()
        cancelled_at = None
        while True:
            try:
                message = messages.get(timeout=0.5)
            except queue.Empty:
                if cancel_flag.is_set():
                    cancelled_at = cancelled_at or time.monotonic()
                    # run() stops at the next stage boundary; a long stage (lowering takes minutes) is not
                    # waited for: the job's process is killed, and atomic writes leave nothing partial.
                    if time.monotonic() - cancelled_at > CANCEL_GRACE_S:
                        process.kill()
                        raise UserFacingError("the job was cancelled; nothing was kept.")
                if not process.is_alive():
                    raise UserFacingError(f"the job stopped unexpectedly (exit code {process.exitcode}); "
                                          "it may have run out of memory. Try a smaller model or fewer recipes.")
                continue
            if message[0] == "progress":
                progress(message[1], message[2])
            elif message[0] == "done":
                return message[1]
            else:
                raise UserFacingError(message[1])
    finally:
        with _CANCELS_LOCK:
            if _CANCELS.get(session) is cancel_flag:
                del _CANCELS[session]
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def cancel_job(session: str) -> bool:
    with _CANCELS_LOCK:
        flag = _CANCELS.get(session)
    if flag is None:
        return False
    flag.set()
    return True


@contextmanager
def job_folder():
    """A new job folder, kept while the job runs; removed whole when the job fails or is cancelled, so a failed
    job leaves nothing behind."""
    job = new_job_dir()
    try:
        yield job
    except BaseException:
        shutil.rmtree(job, ignore_errors=True)
        raise
    finally:
        ACTIVE_JOBS.discard(job)
