"""This process's resident memory, and its peak since a mark: how each stage of a job is measured.

Linux keeps the peak (VmHWM in /proc/self/status) and lets a process reset it (`5` written to
/proc/self/clear_refs), so a stage's peak is exact, not sampled. Elsewhere the peak is the process's
lifetime peak (ru_maxrss), which is still an upper bound of every stage's peak."""
from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
MB = 2**20


def _status_kb(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else peak_bytes()


def lifetime_peak_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux kB


def mark() -> bool:
    """Starts a new peak from the current RSS; False where the kernel does not offer it."""
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_bytes() -> int:
    """The peak RSS since the last `mark()` (the lifetime peak where marks are not possible)."""
    kb = _status_kb("VmHWM")
    return kb * 1024 if kb is not None else lifetime_peak_bytes()
