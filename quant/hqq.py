"""torchao's HQQ scale-only fit of int4 group scales, called a cache-sized block of rows at a time."""
from __future__ import annotations

from contextlib import contextmanager

import torch

# Weight elements per call of torchao's HQQ fit under hqq_by_cache_sized_rows. Its temporaries, a few fp32
# copies of what it fits, then stay in a CPU's cache, and below malloc's mmap threshold (malloc_policy.py), so
# they are reused from the heap rather than mapped and faulted in afresh on each of its iterations.
HQQ_BLOCK_ELEMENTS = 1 << 17


@contextmanager
def hqq_by_cache_sized_rows():
    """torchao's HQQ scale-only fit, called on a block of rows at a time inside the block.

    Each of its iterations sweeps the weight several times in fp32; over a whole decoder matrix every sweep goes
    to memory through freshly mapped temporaries, over a block of rows it stays in cache, several times faster.
    Groups run along a row, so each block's scales and integers are those of the whole call (a test checks they
    are equal)."""
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    whole = intx._choose_qparams_and_quantize_scale_only_hqq

    def by_rows(hp_tensor, block_size, qmin, qmax, **kwargs):
        rows = max(1, HQQ_BLOCK_ELEMENTS // hp_tensor.shape[-1])
        if hp_tensor.shape[0] <= rows:
            return whole(hp_tensor, block_size, qmin, qmax, **kwargs)
        parts = [whole(hp_tensor[start:start + rows], block_size, qmin, qmax, **kwargs)
                 for start in range(0, hp_tensor.shape[0], rows)]
        return torch.cat([qdata for qdata, _ in parts]), torch.cat([scale for _, scale in parts])

    intx._choose_qparams_and_quantize_scale_only_hqq = by_rows
    try:
        yield
    finally:
        intx._choose_qparams_and_quantize_scale_only_hqq = whole
