"""recipes/process/thread_policy.py: OpenMP's process default is 1 in every Lowerbench process, set before torch loads; torch
keeps one thread per core; runtime calls run with the calling thread's torch threads at 1. The speed it
buys is measured by the benchmark (bench/decode.py --stock-threads), not here."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipes.process import thread_policy

ROOT = Path(__file__).resolve().parent.parent

# In a fresh process: OpenMP's default as a thread that torch never touched sees it (the runtime's worker
# threads are such threads), and the calling thread's setting.
PROBE = """
import ctypes, json, os, sys, threading
from recipes.process import thread_policy
applied = thread_policy.limit_openmp_default() if sys.argv[1] == "policy" else None
import torch
torch_threads = thread_policy.torch_threads()
gomp = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line)
omp_get_max_threads = ctypes.CDLL(gomp).omp_get_max_threads
seen = {}
worker = threading.Thread(target=lambda: seen.update(other_thread=omp_get_max_threads()))
worker.start(); worker.join()
print(json.dumps({"applied": applied, "env": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch_threads,
                  "calling_thread": omp_get_max_threads(), **seen}))
"""


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", thread_policy.POLICY_MARK, thread_policy.CORES_ENV)}
    return {**env, **extra}


def _probe(mode: str, env: dict) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_policy_sets_the_openmp_default_to_one_and_keeps_torch_on_every_core():
    cores = thread_policy.physical_cores()
    with_policy = _probe("policy", _clean_env())
    assert with_policy == {"applied": True, "env": "1", "torch_threads": cores, "calling_thread": cores,
                           "other_thread": 1}
    if cores > 1:  # without the policy, a thread torch never touched would start a team of every core
        assert _probe("stock", _clean_env())["other_thread"] == cores


def test_a_users_own_omp_num_threads_is_left_alone():
    probe = _probe("policy", _clean_env(OMP_NUM_THREADS="3"))
    # torch picks its own count from that (here capped at the cores); the policy does not touch it
    assert (probe["applied"], probe["env"], probe["other_thread"]) == (False, "3", 3)


def test_too_late_once_torch_is_loaded():
    code = ("import os, torch; from recipes.process import thread_policy; print(thread_policy.limit_openmp_default(), "
            "os.environ.get('OMP_NUM_THREADS'), os.environ.get(thread_policy.POLICY_MARK))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.split() == ["False", "None", "None"], result.stderr[-2000:]


@pytest.mark.parametrize("entry", [
    "import recipes.__main__ as m; m.main(['list'])",
    "import app\ntry:\n    app.main(['--help'])\nexcept SystemExit:\n    pass",
    "import zoo.__main__ as m\ntry:\n    m.main(['--help'])\nexcept SystemExit:\n    pass",
])
def test_entry_points_apply_it_before_torch_loads(entry):
    # the mark is set only when the default could still be set, that is, before torch was loaded
    code = f"{entry}\nimport os, sys\nfrom recipes.process import thread_policy\nprint(os.environ.get(thread_policy.POLICY_MARK))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "1"


def test_runtime_calls_run_with_one_torch_thread_and_restore_it():
    before = torch.get_num_threads()
    with thread_policy.runtime_threads():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with thread_policy.runtime_threads():
            raise RuntimeError("a failing runtime call")
    assert torch.get_num_threads() == before


def test_runtime_calls_keep_torch_threads_without_a_default_of_one(monkeypatch):
    # with OpenMP's stock default, setting the calling thread alone to 1 measured slower: leave it
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    before = torch.get_num_threads()
    with thread_policy.runtime_threads():
        assert torch.get_num_threads() == before
    assert thread_policy.describe()["torch_during_runtime_calls"] == before


def test_the_suite_itself_runs_under_the_policy():
    assert thread_policy.policy_active() and os.environ["OMP_NUM_THREADS"] == "1"
    assert torch.get_num_threads() == (thread_policy.cores_share() or thread_policy.physical_cores())


def test_a_share_of_the_cores_sets_torchs_threads_and_a_bad_one_is_refused():
    cores = thread_policy.physical_cores()
    probe = _probe("policy", _clean_env(**{thread_policy.CORES_ENV: "1"}))
    assert (probe["applied"], probe["torch_threads"], probe["calling_thread"], probe["other_thread"]) == (True, 1, 1, 1)
    assert _probe("policy", _clean_env(**{thread_policy.CORES_ENV: ""}))["torch_threads"] == cores
    for bad in ("0", "two", "-1", "1.5"):
        result = subprocess.run([sys.executable, "-c", PROBE, "policy"], cwd=ROOT, capture_output=True, text=True,
                                env=_clean_env(**{thread_policy.CORES_ENV: bad}), timeout=300)
        assert result.returncode != 0
        assert f"LOWERBENCH_CORES={bad!r} is not a number of cores: give a whole number from 1" in result.stderr
