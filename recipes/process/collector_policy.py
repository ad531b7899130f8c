"""Python's cycle collector kept off the objects that outlive a graph pass. Quantizing, exporting and lowering make
millions of short-lived objects, so the collector's oldest generation runs again and again, and each run walks
every object the job holds (a quantized module, its tokenizer, the reference's figures): in the built-in model's
full job that made lowering take two thirds longer. Frozen (gc.freeze), those objects are skipped until the
outermost pass ends."""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

_depth = 0


@contextmanager
def collector_skipping_older_objects() -> Iterator[None]:
    """Collects (a cycle that is garbage already is freed, not frozen; objects frozen before are not walked again)
    and freezes what is alive; the outermost block unfreezes it all when it ends. Cycles made inside are collected
    as usual."""
    global _depth
    gc.collect()
    gc.freeze()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            gc.unfreeze()
