"""The one place in Lowerbench that lowers: ExportedProgram + a backend's partitioners ->
executorch.exir.to_edge_transform_and_lower -> to_executorch -> .pte bytes, written atomically."""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class LoweredProgram:
    pte: bytes = field(repr=False)
    edge_graph_module: object = field(repr=False)  # the lowered edge graph, for the delegation report
    edge_nodes_before_partitioning: int | None
    lower_s: float
    serialize_s: float


def export_program(module: torch.nn.Module, max_seq_len: int) -> torch.export.ExportedProgram:
    """One program for prefill and decode: the token dimension is dynamic (1 .. max_seq_len)."""
    example = (torch.zeros((1, 2), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
    seq = torch.export.Dim("seq_len", min=1, max=max_seq_len)
    with torch.no_grad():
        # strict=True: non-strict export of a cache-mutating module fails later in run_decompositions.
        return torch.export.export(module, example, dynamic_shapes=({1: seq}, None), strict=True)


def lower_to_pte(
    program: torch.export.ExportedProgram,
    partitioners: list,
    transform_passes: list | None = None,
    compile_config=None,
) -> LoweredProgram:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    start = time.perf_counter()
    edge = to_edge_transform_and_lower(
        program,
        partitioner=partitioners,
        transform_passes=transform_passes,
        compile_config=compile_config,
    )
    lowered_gm = edge.exported_program().graph_module
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    # Quant fusion turns torchao's dequantize_affine + embedding into ExecuTorch's quantized
    # embedding kernels; without it the leftover dequantize_affine has no out variant.
    executorch_program = edge.to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))
    pte = bytes(executorch_program.buffer)
    serialize_s = time.perf_counter() - start
    return LoweredProgram(pte, lowered_gm, None, lower_s, serialize_s)


def write_atomically(path: Path, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync, rename: readers see the old file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
