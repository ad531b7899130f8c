"""How fast this host runs the two kinds of work a job is made of, measured in a fraction of a second: Python
(exporting, lowering and serializing are graph passes written in Python) and fp32 matrix products (quantizing,
generating and scoring). Two CPUs that run CI differ by about twice in a job's wall: the time estimate's rates,
measured on the zoo's hosts, are scaled by these figures to the host that asks."""
from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

# Each probe runs several times and keeps its fastest run: another process on the cores slows a run down, never
# speeds it up, so the fastest is the host's own speed.
PROBE_RUNS = 40
PYTHON_STEPS = 50_000
MATMUL_SIZE = 256


@dataclass(frozen=True)
class HostSpeed:
    python_mops: float  # million steps a second of a loop of calls and dict updates, as graph passes make
    matmul_gflops: float  # fp32 matrix products on one core

    def to_dict(self) -> dict:
        return {key: round(value, 2) for key, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict | None) -> "HostSpeed | None":
        return cls(**data) if data else None


def _step(table: dict, key: int) -> None:
    table[key & 63] = table.get(key & 63, 0) + key


def _python_seconds() -> float:
    table: dict = {}
    started = time.perf_counter()
    for key in range(PYTHON_STEPS):
        _step(table, key)
    return time.perf_counter() - started


def _matmul_seconds(a, b) -> float:
    started = time.perf_counter()
    for _ in range(4):
        a @ b
    return time.perf_counter() - started


@functools.lru_cache(maxsize=1)
def host_speed() -> HostSpeed:
    """This host's figures, measured once per process (about a third of a second)."""
    import torch

    python_s = min(_python_seconds() for _ in range(PROBE_RUNS))
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: a job beside it takes the other cores, not half of each
    try:
        matmul_s = min(_matmul_seconds(a, b) for _ in range(PROBE_RUNS))
    finally:
        torch.set_num_threads(threads)
    return HostSpeed(python_mops=PYTHON_STEPS / python_s / 1e6, matmul_gflops=4 * 2 * MATMUL_SIZE**3 / matmul_s / 1e9)
