"""How a Lowerbench process shares its cores between torch and the ExecuTorch runtime.

Why: the runtime's `llama::custom_sdpa` kernel calls BLAS (the MKL inside libtorch) from the runtime's own
pthreadpool threads. Those threads are outside any OpenMP region, so each BLAS call there starts an OpenMP
team sized by the process default, one thread per core. On 2 cores the runtime's 2 threads and those
spinning OpenMP teams then fight over the cores. Measured on the built-in model (2 cores, one process each):
runtime prefill 1,100-2,200 tok/s under this policy against 460-820 without it, runtime decode the same,
and the fp32 eager reference's decode in the same processes 10-15 % faster too.

1. `limit_openmp_default()`, first thing in a process, before anything imports torch: OpenMP's process
   default becomes 1 thread (OpenMP reads it once, when torch loads it). Child processes inherit it.
2. `torch_threads()`, where torch work starts: torch took that 1 as its own default too, so its intra-op
   threads go back to one per physical core, torch's usual default. Only the calling thread's OpenMP
   setting changes, and threads torch starts later follow it; the runtime's threads keep the default of 1.
3. `runtime_threads()`, around every runtime call: the calling thread also runs runtime work (and its BLAS
   calls), so its torch/OpenMP threads are 1 for the call. Without this step the default alone makes decode
   ~40 % slower: the calling thread's BLAS then starts a team of 2 that spins against the runtime's worker.
   Step 3 needs step 1: with OpenMP's stock default, setting the calling thread alone to 1 made prefill
   slower than leaving it (480-520 against 870-890 tok/s), so then it does nothing.

A user's own OMP_NUM_THREADS is left alone (step 3 then applies only if it is 1). So is a process that loaded
torch before step 1 (a script importing Lowerbench's functions): it runs with torch's stock threads.

A process that shares the cores with others of its kind (parallel test workers, several jobs on one host) is
given its share with LOWERBENCH_CORES=N: torch's intra-op threads are N, not one per core. Two processes of
two OpenMP threads each on two cores spin against each other: every parallel region's waiting threads hold a
core the other process needs.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

# set together with OMP_NUM_THREADS=1 by this module, so a process (or its children) can tell the policy's
# 1 from a user's own setting
POLICY_MARK = "LOWERBENCH_OPENMP_DEFAULT_1"
CORES_ENV = "LOWERBENCH_CORES"


def limit_openmp_default() -> bool:
    """True when OpenMP's default is the policy's 1 thread in this process; False when the user set
    OMP_NUM_THREADS, or torch was already loaded (then OpenMP has read its default and this is too late)."""
    if policy_active():
        return True
    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[POLICY_MARK] = "1"
    return True


def policy_active() -> bool:
    return os.environ.get(POLICY_MARK) == "1" and openmp_default_is_one()


def physical_cores() -> int:
    """torch's own default for its intra-op threads (cpuinfo's core count), here via psutil."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def cores_share() -> int | None:
    """The cores LOWERBENCH_CORES gives this process, or None when it is unset."""
    value = os.environ.get(CORES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{CORES_ENV}={value!r} is not a number of cores: give a whole number from 1, "
                         f"or unset it to use every core")
    return int(value)


def torch_threads() -> int:
    """torch's intra-op threads at the process's share of the cores (LOWERBENCH_CORES) when it has one, else,
    under the policy, back to one per physical core; returns the count in use."""
    import torch

    share = cores_share()
    if share is not None:
        torch.set_num_threads(share)
    elif policy_active():
        torch.set_num_threads(physical_cores())
    return torch.get_num_threads()


def openmp_default_is_one() -> bool:
    return os.environ.get("OMP_NUM_THREADS") == "1"


@contextmanager
def runtime_threads():
    """When OpenMP's default is 1: torch/OpenMP threads of the calling thread at 1 while it runs the
    ExecuTorch runtime (which parallelises with its own thread pool), restored after; 1.4 µs per call,
    context manager included (measured). Otherwise nothing (see step 3 above)."""
    if not openmp_default_is_one():
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def describe() -> dict:
    """For reports: the thread setup the figures were measured under."""
    import torch

    user_set = "OMP_NUM_THREADS" in os.environ and not policy_active()
    return {"openmp_default": os.environ.get("OMP_NUM_THREADS"),
            "openmp_default_set_by": "lowerbench" if policy_active() else ("user" if user_set else None),
            "cores_share": cores_share(),
            "torch_intra_op": torch.get_num_threads(),
            "torch_during_runtime_calls": 1 if openmp_default_is_one() else torch.get_num_threads()}
