"""How a Lowerbench process hands freed memory back to the system, so its RSS is what the job holds.

1. `unmap_large_blocks()`, where a job starts. Why: glibc serves a request above its mmap threshold with a
   mapping of its own, unmapped again on free, but every such free raises the threshold to the freed size (up
   to 32 MiB). After the first large tensor of a job is freed, the next ones (a unit's weights read in fp32,
   the quantizer's temporaries, export's copies) come from the heap arenas instead, and what they free stays
   in the process. A fixed threshold turns that adjustment off: each block of at least `MMAP_THRESHOLD_BYTES`
   is its own mapping and leaves RSS when torch frees it. Measured at Llama-3.2-1B's shape (8da4w,
   export-only), the job's peak became lower and steady from run to run; the price, a fresh zeroed mapping
   for each large tensor, is small beside the work on that tensor.
2. `trim_freed_heap()`, between stages: what stays in the heap (blocks below the threshold) goes back, so the
   next stage starts from what the job holds.
3. `reusing_large_blocks()`, around a stage that runs the model pass after pass (a calibrated search): its
   activations and dequantized weights come back at the same sizes every pass, and a fresh mapping for each costs
   a page fault per 4 KiB page, which there outweighs the arithmetic. The heap keeps them for reuse during the
   stage and gives back what is free when it ends.
4. `keeping_freed_heap()`, around quantizing a unit: HQQ's fit runs a few dozen ops on a cache-sized block of
   rows, thousands of blocks a unit, each op's result below the mmap threshold and so from the heap. With glibc's
   stock trim threshold every free at the top of the heap hands those pages back, and the next op faults them in
   again; how often depends on what earlier stages left in the heap (after AWQ's search, nearly every op). Kept
   for the unit, the same pages serve every block, and the fit runs at the speed of its arithmetic.

Other C libraries (macOS, musl) are left as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from contextlib import contextmanager

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20
REUSE_THRESHOLD_BYTES = 32 << 20  # the largest glibc takes (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
STOCK_TRIM_THRESHOLD_BYTES = 128 << 10
_fixed = False


@functools.cache
def _glibc():
    """The C library already loaded in this process when it is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def unmap_large_blocks() -> bool:
    """Fixes glibc's mmap threshold for this process. True when it applied."""
    global _fixed
    libc = _glibc()
    _fixed = libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return _fixed


@contextmanager
def keeping_freed_heap():
    """What is freed at the top of the heap stays there for the block, where unmap_large_blocks applied; it goes
    back when the block ends. Large blocks keep their own mappings."""
    libc = _glibc()
    if not _fixed or libc is None:
        yield
        return
    # as much as glibc's own adjustment would keep beside the largest heap block (twice the threshold)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * REUSE_THRESHOLD_BYTES)
    try:
        yield
    finally:
        libc.mallopt(M_TRIM_THRESHOLD, STOCK_TRIM_THRESHOLD_BYTES)
        libc.malloc_trim(0)


@contextmanager
def reusing_large_blocks():
    """Blocks up to REUSE_THRESHOLD_BYTES come from the heap for the block, and what is freed stays there for
    reuse (keeping_freed_heap), where unmap_large_blocks applied."""
    libc = _glibc()
    if not _fixed or libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, REUSE_THRESHOLD_BYTES)
    try:
        with keeping_freed_heap():
            yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def trim_freed_heap() -> None:
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
