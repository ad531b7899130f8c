"""Where a .pte's time goes on the ExecuTorch runtime. A second pass of the same generation, after the timed one
(so the event tracer never touches the report's figures), with the runtime's event tracer on: ETDumps of the
load, the prefill and the decode steps, read back with ExecuTorch's Inspector into a per-op table of a decode
step and of the prefill."""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from recipes.running import generate as gen
from recipes.files.atomic_write import write_atomically
from recipes.files.pte_program import data_file_of, read_program
from recipes.output.report import OpRow, PhaseProfile, Profile, ProfileFiles, ProfileLoad

ETDUMP_NAME = "model.etdump"  # the decode steps
PREFILL_ETDUMP_NAME = "prefill.etdump"
ETRECORD_NAME = "etrecord.bin"

NO_EVENT_TRACER = (
    "this ExecuTorch runtime (executorch {version}) is built without its event tracer "
    "(EXECUTORCH_ENABLE_EVENT_TRACER), so it writes no ETDump; executorch 1.5.1's wheel has it"
)

# Inspector's names for the runtime's own events; every other event inside a delegate is one of its ops.
METHOD_EXECUTE, OPERATOR_CALL, DELEGATE_CALL = "Method::execute", "OPERATOR_CALL", "DELEGATE_CALL"
LOAD_METHOD, METHOD_INIT = "Program::load_method", "Method::init"
BETWEEN_INSTRUCTIONS = "runtime, between instructions"
DELEGATE_OUTSIDE_OPS = "{backend}, outside its op events"


def instruction_names(pte: Path | bytes) -> dict[int, tuple[str, str | None]]:
    """Instruction id -> (operator name, None) for a kernel call, (backend id, backend id) for a delegate call,
    read from the .pte's execution plan: what an ETDump event's instruction id points at."""
    plan = next(p for p in read_program(pte).execution_plan if p.name == "forward")
    names = {}
    for index, instruction in enumerate(i for chain in plan.chains for i in chain.instructions):
        args = instruction.instr_args
        if hasattr(args, "delegate_index"):
            backend = plan.delegates[args.delegate_index].id
            names[index] = (backend, backend)
        elif hasattr(args, "op_index"):
            operator = plan.operators[args.op_index]
            names[index] = (f"{operator.name}.{operator.overload}" if operator.overload else operator.name, None)
    return names


def _runs(inspector) -> list[dict]:
    """One dict per execute() in the ETDump: (op, delegated, backend) -> [ms of each instance], plus the
    run's Method::execute and DELEGATE_CALL totals. Inspector merges runs with the same events into one block;
    each event's perf_data.raw holds one value per run of its block, in run order."""
    runs = []
    for block in inspector.event_blocks:
        execute = next((e for e in block.events if e.name == METHOD_EXECUTE and e.perf_data), None)
        if execute is None:
            continue
        for run in range(len(execute.perf_data.raw)):
            runs.append({"events": [(e, e.perf_data.raw[run]) for e in block.events if e.perf_data],
                         "execute": execute.perf_data.raw[run]})
    return runs


def _run_rows(run: dict, names: dict) -> tuple[dict, float]:
    """(op key -> [ms per instance], time inside delegate calls) of one run. Each kernel instruction's time is its
    OPERATOR_CALL (the kernel plus its dispatch); a delegate's op events are inside its DELEGATE_CALL, and what
    they leave of it is the delegate's own row; what the instructions leave of Method::execute is the runtime's."""
    rows: dict[tuple, list[float]] = defaultdict(list)
    inside_ops: dict[int, float] = defaultdict(float)
    delegate_calls: dict[int, float] = {}
    for event, ms in run["events"]:
        instruction = event._instruction_id
        if event.is_delegated_op:
            backend = names.get(instruction, (None, event.delegate_backend_name))[1]
            rows[(re.sub(r" #\d+$", "", event.name), True, backend)].append(ms)
            inside_ops[instruction] += ms
        elif event.name == DELEGATE_CALL:
            delegate_calls[instruction] = ms
        elif event.name == OPERATOR_CALL:
            rows[(names.get(instruction, (f"instruction {instruction}", None))[0], False, None)].append(ms)
    for instruction, ms in delegate_calls.items():
        backend = names.get(instruction, (None, None))[1]
        rows[(DELEGATE_OUTSIDE_OPS.format(backend=backend), True, backend)].append(ms - inside_ops[instruction])
    delegated = sum(delegate_calls.values())
    kernels = sum(sum(v) for (op, is_delegated, _), v in rows.items() if not is_delegated)
    rows[(BETWEEN_INSTRUCTIONS, False, None)].append(run["execute"] - delegated - kernels)
    return rows, delegated


def phase_profile(runs: list[dict], names: dict, measured_ms: list[float]) -> PhaseProfile:
    per_run = [_run_rows(run, names) for run in runs]
    keys = list(dict.fromkeys(key for rows, _ in per_run for key in rows))
    execute = [run["execute"] for run in runs]
    step_ms = statistics.fmean(execute)
    ops = []
    for key in keys:
        sums = [sum(rows.get(key, [])) for rows, _ in per_run]
        mean = statistics.fmean(sums)
        ops.append(OpRow(op=key[0], delegated=key[1], backend=key[2],
                         count=max(len(rows.get(key, [])) for rows, _ in per_run),
                         ms_per_step=round(mean, 4), p50_ms_per_step=round(statistics.median(sums), 4),
                         percent_of_step=round(100 * mean / step_ms, 2) if step_ms else 0.0))
    ops.sort(key=lambda row: row.ms_per_step, reverse=True)
    outside = sum(execute) - sum(delegated for _, delegated in per_run)
    return PhaseProfile(steps=len(runs), step_ms=round(step_ms, 4), step_p50_ms=round(statistics.median(execute), 4),
                        measured_step_ms=round(statistics.fmean(measured_ms), 4),
                        measured_p50_ms=round(statistics.median(measured_ms), 4),
                        outside_delegates_percent=round(100 * outside / sum(execute), 2) if sum(execute) else 0.0,
                        ops=ops)


def _inspector(etdump: Path):
    import warnings

    from executorch.devtools import Inspector

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Output Buffer not found": no debug buffer is asked for
        return Inspector(etdump_path=str(etdump))


def _load_figures(inspector, program_load_ms: float) -> ProfileLoad:
    by_name = {e.name: e.perf_data.raw[0] for block in inspector.event_blocks for e in block.events if e.perf_data}
    return ProfileLoad(program_load_ms=round(program_load_ms, 3),
                       load_method_ms=round(by_name.get(LOAD_METHOD, 0.0), 3),
                       method_init_ms=round(by_name.get(METHOD_INIT, 0.0), 3),
                       first_call_ms=round(by_name.get(METHOD_EXECUTE, 0.0), 3))


def event_tracer_note() -> str:
    return NO_EVENT_TRACER.format(version=importlib.metadata.version("executorch"))


def _traced_generation(pte_path: Path, tmp: Path, generate_once) -> tuple[dict, float, list[float]] | None:
    """Loads the .pte with the event tracer on and runs `generate_once(step)`, writing load.etdump,
    prefill.etdump and model.etdump into `tmp`: (their paths, the program's load ms, each step's wall ms), or
    None when this runtime writes no ETDump. The program is released on return, before the ETDumps are read."""
    from executorch.runtime import Runtime

    started = time.perf_counter()
    ptd = data_file_of(pte_path)
    program = Runtime.get().load_program(str(pte_path), enable_etdump=True,
                                         data_path=str(ptd) if ptd is not None else None)
    program_load_ms = 1000 * (time.perf_counter() - started)
    step = gen.runtime_step((program, program.load_method("forward")))
    written: dict[str, Path] = {}

    def write(name: str) -> Path:
        # The runtime writes the events since its last write and starts over: one file per phase.
        path = tmp / name
        program.write_etdump_result_to_file(str(path), str(tmp / f"{name}.debug"))
        written[name] = path
        return path

    if not write("load.etdump").is_file():
        return None
    measured: list[float] = []

    def traced_step(tokens, input_pos):
        started = time.perf_counter()
        logits = step(tokens, input_pos)
        measured.append(1000 * (time.perf_counter() - started))
        if len(measured) == 1:
            write(PREFILL_ETDUMP_NAME)
        return logits

    generate_once(traced_step)
    write(ETDUMP_NAME)
    return written, program_load_ms, measured


def profile_pte(pte_path: Path, runtime_imports: tuple[str, ...], generate_once) -> tuple[Profile | None, str | None]:
    """Loads the .pte with the event tracer on, warms it up as the timed run does, and runs `generate_once(step)`
    (the same generation); writes prefill.etdump and model.etdump beside the .pte. (profile, None), or
    (None, why not) when this runtime writes no ETDump."""
    pte_path = Path(pte_path)
    out_dir = pte_path.parent
    for name in runtime_imports:
        importlib.import_module(name)
    with tempfile.TemporaryDirectory(prefix="lowerbench-etdump-") as tmp:
        traced = _traced_generation(pte_path, Path(tmp), generate_once)
        if traced is None:
            return None, event_tracer_note()
        written, program_load_ms, measured = traced
        load = _load_figures(_inspector(written["load.etdump"]), program_load_ms)
        names = instruction_names(pte_path)
        prefill = phase_profile(_runs(_inspector(written[PREFILL_ETDUMP_NAME])), names, measured[:1])
        decode_runs = _runs(_inspector(written[ETDUMP_NAME]))
        decode = phase_profile(decode_runs, names, measured[1:]) if decode_runs else None
        for name in (PREFILL_ETDUMP_NAME, ETDUMP_NAME):
            write_atomically(out_dir / name, written[name].read_bytes())
    files = ProfileFiles(etdump=ETDUMP_NAME, prefill_etdump=PREFILL_ETDUMP_NAME,
                         etrecord=ETRECORD_NAME if (out_dir / ETRECORD_NAME).is_file() else None)
    return Profile(engine=gen.ENGINE_RUNTIME, executorch=importlib.metadata.version("executorch"), load=load,
                   prefill=prefill, decode=decode, files=files), None


def recipe_profile(pte_path: Path | None, runtime_imports: tuple[str, ...], generate_once, generated: bool,
                   runtime_note: str | None, enabled: bool = True) -> tuple[Profile | None, str | None]:
    """The recipe's profile and, when there is none, why not (its report's profile_note): pte_path is None when
    no .pte was written, `generated` says whether the job generated at all, runtime_note why the .pte does not
    run here. A failed profile never withholds a good .pte."""
    if not enabled:
        return None, "profiling was turned off (--no-profile)"
    if pte_path is None:
        return None, "no .pte was written"
    if not generated:
        return None, "export only: nothing was generated to profile"
    if runtime_note:
        return None, f"the .pte does not run here: {runtime_note}"
    try:
        return profile_pte(Path(pte_path), runtime_imports, generate_once)
    except Exception as err:
        return None, f"profiling failed: {type(err).__name__}: {err}"
