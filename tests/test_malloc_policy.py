"""The process policy that returns freed tensor memory: checked in fresh interpreters, with and without it,
on the allocation pattern of quantizing unit by unit (large temporaries between blocks that stay)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, sys
from recipes.process import malloc_policy
applied = malloc_policy.unmap_large_blocks() if sys.argv[1] == "on" else False
import psutil, torch
rss = lambda: psutil.Process().memory_info().rss
big = torch.ones(16 << 18)  # 16 MiB: mapped, and its unmapping raises glibc's stock threshold to its size
del big
before = rss()
temporaries, kept = [], []
for _ in range(100):  # 2 MiB temporaries, each followed by a small block that stays, as a quantized piece does
    temporaries.append(torch.ones(2 << 18))
    kept.append(torch.ones(64))
del temporaries
print(json.dumps({"applied": applied, "retained_mib": (rss() - before) / 2**20}))
"""


def _probe_figures(probe: str, *args: str) -> dict:
    """The JSON a probe prints last, run in a fresh interpreter from the repository's root."""
    out = subprocess.run([sys.executable, "-c", probe, *args], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="the policy is glibc's")
def test_freed_temporaries_leave_rss_under_the_policy_and_stay_without_it():
    with_policy, without = _probe_figures(PROBE, "on"), _probe_figures(PROBE, "off")
    assert with_policy["applied"] is True
    assert without["retained_mib"] > 150  # the stock allocator keeps the freed 200 MiB
    assert with_policy["retained_mib"] < 10


REUSE_PROBE = """
import json, resource
from recipes.process import malloc_policy
malloc_policy.unmap_large_blocks()
import psutil, torch
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def passes():  # a pass's 4 MiB activations, made and freed again and again
    start = faults()
    for _ in range(100):
        torch.ones(1 << 20).add_(1)
    return faults() - start
mapped = passes()
before = psutil.Process().memory_info().rss
with malloc_policy.reusing_large_blocks():
    reused = passes()
    held = [torch.ones(1 << 20) for _ in range(50)]  # 200 MiB from the heap, freed inside the block
    del held
print(json.dumps({"mapped": mapped, "reused": reused,
                  "retained_mib": (psutil.Process().memory_info().rss - before) / 2**20}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the policy is glibc's")
def test_a_pass_after_pass_stage_reuses_its_blocks_and_gives_them_back_when_it_ends():
    figures = _probe_figures(REUSE_PROBE)
    assert figures["mapped"] > 50_000  # a zeroed page per 4 KiB, every pass
    assert figures["reused"] < figures["mapped"] / 20
    assert figures["retained_mib"] < 20


KEEP_PROBE = """
import ctypes, json, resource
from recipes.process import malloc_policy
malloc_policy.unmap_large_blocks()
import psutil
libc = malloc_policy._glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
with malloc_policy.reusing_large_blocks():  # a search before, whose end sets the stock trim threshold
    pass
def fit():  # an HQQ fit's shape: an op's 512 KiB result, below the mmap threshold, written and freed again
    start = faults()
    for _ in range(200):
        block = libc.malloc(512 << 10)
        ctypes.memset(block, 1, 512 << 10)
        libc.free(block)
    return faults() - start
trimmed = fit()
before = psutil.Process().memory_info().rss
with malloc_policy.keeping_freed_heap():
    kept = fit()
print(json.dumps({"trimmed": trimmed, "kept": kept,
                  "retained_mib": (psutil.Process().memory_info().rss - before) / 2**20}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the policy is glibc's")
def test_quantizing_a_unit_keeps_its_freed_heap_pages_and_gives_them_back_after():
    figures = _probe_figures(KEEP_PROBE)
    # glibc's own calls from the main thread, not torch's ops, whose allocations differ with the CPU's kernels
    assert figures["trimmed"] > 100 * 128  # the freed top of the heap handed back, and faulted in again, every op
    assert figures["kept"] < figures["trimmed"] / 20
    assert figures["retained_mib"] < 10
