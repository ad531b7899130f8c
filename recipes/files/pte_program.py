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


def method_interfaces(pte: Path) -> dict[str, dict]:
    """Each method's interface as a runner reads it from ExecuTorch's method_meta: {method: {"inputs": [(dtype,
    sizes, memory planned)], "outputs": [...]}} for a method that takes tensors, {method: {"value": ...}} for a constant method
    (loaded and run: it holds no delegate)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte))
    interfaces = {}
    for name in sorted(program.method_names):
        meta = program.metadata(name)
        if meta.num_inputs() == 0:
            (value,) = program.load_method(name).execute([])
            interfaces[name] = {"value": value}
            continue
        interfaces[name] = {
            "inputs": [_tensor_spec(meta.input_tensor_meta(i)) for i in range(meta.num_inputs())],
            "outputs": [_tensor_spec(meta.output_tensor_meta(i)) for i in range(meta.num_outputs())],
        }
    return interfaces


# ExecuTorch's ScalarType codes (runtime/core/portable_type/scalar_type.h) of the dtypes LLM programs take.
_SCALAR_TYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 11: "bool",
                 15: "bfloat16", 27: "uint16"}


def _tensor_spec(meta) -> tuple[str, tuple[int, ...], bool]:
    code = int(meta.dtype())
    return _SCALAR_TYPES.get(code, f"scalar type {code}"), tuple(meta.sizes()), bool(meta.is_memory_planned())
