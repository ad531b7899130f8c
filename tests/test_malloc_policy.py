"""The process policy that returns freed tensor memory: checked in fresh interpreters, with and without it,
on the allocation pattern of quantizing unit by unit (large temporaries between blocks that stay)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, sys
import malloc_policy
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


def _retained(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform != "linux", reason="the policy is glibc's")
def test_freed_temporaries_leave_rss_under_the_policy_and_stay_without_it():
    with_policy, without = _retained("on"), _retained("off")
    assert with_policy["applied"] is True
    assert without["retained_mib"] > 150  # the stock allocator keeps the freed 200 MiB
    assert with_policy["retained_mib"] < 10
