"""A .pte's program table (execution plans, operators, delegate ids) read without its segments, and the data
file (.ptd) that may sit beside it.

The segments after the flatbuffer hold the delegates' payloads and the constants, nearly all of a .pte's bytes;
what names an instruction or a delegate is in the flatbuffer before them, so only that part is read. A program
whose delegates keep their weights in ExecuTorch's named data may carry them in a .ptd instead: the runtime
then needs both files."""
from __future__ import annotations

from pathlib import Path

PTE_NAME, PTD_NAME = "model.pte", "model.ptd"

# ExecuTorch's extended header sits in the file's first bytes (kNumHeadBytes in its extended_header.cpp).
HEAD_BYTES = 64


def read_program(pte: Path | bytes):
    """The .pte's Program (executorch.exir.schema), with no segment data restored into it."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    if isinstance(pte, bytes):
        header = _get_extended_header(pte[:HEAD_BYTES])
        flatbuffer = pte[:header.program_size] if header else pte
    else:
        with open(pte, "rb") as file:
            header = _get_extended_header(file.read(HEAD_BYTES))
            file.seek(0)
            flatbuffer = file.read(header.program_size) if header else file.read()
    return _flatbuffer_to_program(flatbuffer)


def delegate_ids(pte: Path | bytes) -> list[str]:
    """Backend ids of the delegates in a .pte."""
    return sorted({d.id for plan in read_program(pte).execution_plan for d in plan.delegates})


def data_file_of(pte: Path | str | bytes) -> Path | None:
    """The .ptd beside a .pte file (same name, .ptd), or None when it has none."""
    if isinstance(pte, bytes):
        return None
    ptd = Path(pte).with_suffix(".ptd")
    return ptd if ptd.is_file() else None
