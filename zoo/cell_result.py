"""zoo/results.json as dataclasses: what `python -m zoo matrix` records of one model × recipe (`CellResult`), and the
document that holds every cell (`ZooResults`). `to_dict()` is the one way a cell is written (its cells/ file and
results.json) and `from_dict()` the one way it is read back.

A cell is one flat JSON object. Its parts (`TaskHost`, `JobFigures`) are typed here but keep their keys in the
cell's own object, where the matrix has always written them; a part the cell lacks (a refused cell ran no task and
has no figures) writes no key. Cells written by earlier versions lack keys added since (`params`, `measured_at`,
`host_speed`, `stages_s`, `quant_algorithm`, ...): a key a record was read without reads as None and is left out
again when the record is written back, while a key read as null is written as null, so a results.json reads back
byte for byte. A key this version does not know is kept as it is, after the known ones.

Torch-free: the app's server process reads the zoo before its thread policy is set."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from recipes.estimates.host_speed import HostSpeed


def part(cls):
    """A nested part whose keys sit in the cell's own JSON object; None when the record has none of them."""
    return field(default=None, metadata={"part": cls})


def left_out_when_none():
    """A key only some kinds of cell have (a refusal's estimate, a task's seconds): not written when None."""
    return field(default=None, metadata={"omit_none": True})


@dataclass
class FlatRecord:
    """Keys are fields, in field order; a `part` field's keys follow in its place, in the same object."""

    # keys of this version the record was read without (written by an earlier version): left out again when written
    absent_keys: frozenset[str] = field(default=frozenset(), repr=False, compare=False, kw_only=True)

    def to_dict(self) -> dict:
        data = {}
        for f in _record_fields(type(self)):
            value = getattr(self, f.name)
            if "part" in f.metadata:
                data.update(value.to_dict() if value is not None else {})
            elif f.metadata.get("spread"):
                data.update(value)
            elif f.name in self.absent_keys or (value is None and f.metadata.get("omit_none")):
                continue
            else:
                data[f.name] = value.to_dict() if hasattr(value, "to_dict") else value
        return data

    @classmethod
    def from_dict(cls, data: dict):
        values, absent = {}, set()
        for f in _record_fields(cls):
            if "part" in f.metadata:
                kind = f.metadata["part"]
                values[f.name] = kind.from_dict(data) if set(data) & set(keys_of(kind)) else None
            elif f.metadata.get("spread"):
                values[f.name] = {key: value for key, value in data.items() if key not in keys_of(cls)}
            elif f.name in data:
                load, value = f.metadata.get("load"), data[f.name]
                values[f.name] = load(value) if load is not None and value is not None else value
            else:
                absent.add(f.name)
        return cls(**values, absent_keys=frozenset(absent))


def _record_fields(cls) -> list:
    return [f for f in fields(cls) if f.name != "absent_keys"]


def keys_of(cls) -> list[str]:
    """Every JSON key a record of this kind can hold, its parts' included."""
    keys = []
    for f in _record_fields(cls):
        if "part" in f.metadata:
            keys += keys_of(f.metadata["part"])
        elif not f.metadata.get("spread"):
            keys.append(f.name)
    return keys


@dataclass
class TaskHost(FlatRecord):
    """The node the cell's Ray task ran on, and what it offered the job."""
    host: str | None = None
    memory_limit_bytes: float | None = None  # what the node offered a task: the job planned its memory for it
    host_speed: HostSpeed | None = field(default=None, metadata={"load": HostSpeed.from_dict})


@dataclass
class JobFigures(FlatRecord):
    """What the cell's job measured, from its report.json (recipes/output/report.py): present when the job ran to
    its report, even where a stage of it failed."""
    delegated_percent: float | None = None
    pte_mb: float | None = None
    ptd_mb: float | None = left_out_when_none()  # the weights file beside the .pte, for a program that has one
    export_s: float | None = None
    lower_s: float | None = None
    peak_rss_mb: float | None = None
    decode_tokens_per_s: float | None = None  # None for an export-only job
    engine: str | None = None  # what produced the decode speed: the runtime, the LLM runner or an eager stand-in
    perplexity_ratio: float | None = None  # None on random weights
    fidelity: str | None = None  # "measured", "not measured" or zoo.entries.NEEDS_REAL_WEIGHTS
    runtime_note: str | None = None  # why the .pte could not run here
    # each stage's seconds (a report's timings_s), measured with the whole node: the time estimate's rates
    stages_s: dict[str, float] | None = None
    alone: bool | None = None  # nothing ran beside it, so its stages' seconds are rates
    quant_algorithm: str | None = None  # the int4 algorithm the job ran; None: the scheme takes none

    @property
    def files_mb(self) -> float | None:
        """What a device is handed: the .pte and, for a program that keeps its weights apart, its .ptd."""
        return None if self.pte_mb is None else round(self.pte_mb + (self.ptd_mb or 0.0), 2)


@dataclass
class CellResult(FlatRecord):
    """One cell of the matrix: what was asked (model, recipe, options, context, export only), where and when it was
    measured, how it ended (`status`: ok, failed, refused or oom, with the stage and reason of one that did not
    finish) and what it measured."""
    key: str | None = None  # zoo.matrix.Cell.key: what makes two results comparable
    model: str | None = None  # the Hub repo id
    recipe: str | None = None
    backend: str | None = None
    params: int | None = None
    options: dict | None = None
    max_seq_len: int | None = None
    export_only: bool | None = None
    weights: str | None = None  # random bf16, the built-in GGUF or the Hub's
    model_identity: str | None = None
    versions: dict[str, str | None] | None = None  # package -> version
    date: str | None = None
    measured_at: str | None = None
    cpu: str | None = None
    cores: int | None = None
    task: TaskHost | None = part(TaskHost)
    status: str | None = None
    stage: str | None = None
    reason: str | None = None
    figures: JobFigures | None = part(JobFigures)
    estimate_gib: float | None = left_out_when_none()  # a refusal's estimated peak
    seconds: float | None = left_out_when_none()  # the task's wall, for a cell that ran
    other: dict = field(default_factory=dict, metadata={"spread": True})  # keys this version does not know

    @property
    def measured(self) -> JobFigures:
        """The job's figures; every one None for a cell that reached no report (refused, killed, failed early)."""
        return self.figures or JobFigures()

    @property
    def executorch_version(self) -> tuple[int, ...]:
        version = (self.versions or {}).get("executorch") or ""
        return tuple(int(piece) for piece in version.split("+")[0].split(".") if piece.isdigit())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass
class ZooResults:
    """results.json: when and where it was written, and the latest cell of each question the matrix asked."""
    generated: str | None = None
    cpu: str | None = None
    cores: int | None = None
    cells: list[CellResult] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"generated": self.generated, "cpu": self.cpu, "cores": self.cores,
                "cells": [cell.to_dict() for cell in self.cells]}

    @classmethod
    def from_dict(cls, data: dict) -> ZooResults:
        return cls(data.get("generated"), data.get("cpu"), data.get("cores"),
                   [CellResult.from_dict(cell) for cell in data.get("cells", [])])

    def to_json(self) -> str:
        """As the matrix writes it: two-space indent, no newline at the end."""
        return json.dumps(self.to_dict(), indent=2)


def load_results(path: Path) -> ZooResults:
    """A results.json; an empty one where there is no file."""
    path = Path(path)
    return ZooResults.from_dict(json.loads(path.read_text())) if path.is_file() else ZooResults()


def load_cell(path: Path) -> CellResult:
    """One cell's file of a matrix's cells/ folder."""
    return CellResult.from_dict(json.loads(Path(path).read_text()))
