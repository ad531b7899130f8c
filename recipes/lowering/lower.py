"""The one place in Lowerbench that lowers: ExportedProgram + a backend's partitioners ->
executorch.exir.to_edge_transform_and_lower -> to_executorch -> .pte, written atomically."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import logging
import os
import re
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, ContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models import torch_export
from recipes.process import malloc_policy
from recipes.process import rss
from recipes.files.atomic_write import write_atomically
from recipes.process.collector_policy import collector_skipping_older_objects
from recipes.lowering.delegation import methods_delegation_table
from recipes.output.report import Delegation


class OutputWriteError(OSError):
    """The .pte could not be written (disk full, no permission): the whole job's failure, not one recipe's."""


@dataclass
class LoweredProgram:
    # The .pte's bytes, or None when it went straight to `pte_path` (see lower_to_pte): then `pte` reads the file.
    pte_data: bytes | None = field(repr=False)
    delegation: Delegation  # of the lowered edge graph, read before to_executorch (recipes/lowering/delegation.py)
    edge_nodes_before_partitioning: int | None
    lower_s: float
    serialize_s: float
    # peak RSS of this process while lowering and while serializing (recipes/process/rss.py)
    lower_peak_rss_mb: float | None = None
    serialize_peak_rss_mb: float | None = None
    etrecord: bytes | None = field(default=None, repr=False)  # ExecuTorch's ETRecord, when asked for
    pte_path: Path | None = None
    pte_bytes: int = 0
    pte_sha256: str = ""
    # The delegates' weights, when they went to a data file beside the .pte (ExecuTorch's .ptd)
    ptd_path: Path | None = None
    ptd_bytes: int = 0
    ptd_sha256: str = ""

    @property
    def pte(self) -> bytes:
        return self.pte_data if self.pte_data is not None else Path(self.pte_path).read_bytes()


def op_type(node_name: str) -> str:
    """The op type of an edge node, named as get_delegation_info names it (node name minus _N)."""
    return re.sub(r"_[\d]+$", "", node_name)


class _EdgeOpCounter:
    """A transform pass that changes nothing: it runs after to_edge and before partitioning, so it
    sees the edge graph the partitioners get."""

    def __init__(self):
        self.counts: Counter = Counter()

    def __call__(self, graph_module):
        from torch.fx.passes.infra.pass_base import PassResult

        # summed over the methods of a program of several (the pass runs on each)
        self.counts += Counter(op_type(n.name) for n in graph_module.graph.nodes if n.op == "call_function")
        return PassResult(graph_module, False)


class _PartitionerLog(logging.Handler):
    """Collects what partitioners log while lowering ("Skipping op ..." messages at INFO, WhyNoPartition
    records at DEBUG) and passes on to the usual handlers what they would have shown."""

    def __init__(self, shown_level: int):
        super().__init__(logging.DEBUG)
        self.shown_level, self.records = shown_level, []

    def emit(self, record: logging.LogRecord) -> None:
        node = getattr(record.msg, "node", None)  # WhyNoPartition carries the rejected node
        reason = getattr(record.msg, "reason", None)
        self.records.append({
            "source": record.name,
            "op": op_type(node.name) if node is not None else None,
            "reason": str(reason) if reason is not None else record.getMessage(),
        })
        own_level = logging.getLogger(record.name).level
        if record.levelno >= (own_level or self.shown_level):
            logging.getLogger().handle(record)


@contextmanager
def _capture_partitioner_logs():
    root = logging.getLogger("executorch")
    saved = root.level, root.propagate
    handler = _PartitionerLog(root.getEffectiveLevel())
    root.setLevel(logging.DEBUG)
    root.propagate = False
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


def _release_cached_programs() -> None:
    """Once a program is lowered (or failed to), lets go of what ExecuTorch and torch keep of it process-wide.
    Each of these reaches the lowered program with every delegate's payload, a .pte's worth of memory, which
    would otherwise stay until the next lowering or the end of the process:
    - the module-level WhyNoPartition objects partitioners log through keep the last node they logged;
    - ExecuTorch's is_same_node is a functools cache keyed by nodes;
    - fake-tensor dispatch caches (each ShapeEnv's, and FakeTensorMode's own) are keyed by what the traces
      dispatched on, the lowered modules included; torch keeps ShapeEnvs alive in caches of its own.
    Clearing a cache only costs its recomputation."""
    from executorch.exir.backend import utils as backend_utils
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("executorch."):
            for value in list(vars(module).values()):
                if isinstance(value, backend_utils.WhyNoPartition):
                    value.node = None
    backend_utils.is_same_node.cache_clear()
    FakeTensorMode.cache_clear()
    for value in gc.get_objects():
        if type(value) is ShapeEnv:
            getattr(value, "fake_tensor_cache", {}).clear()


def _record_preserved_ops(partitioners: list) -> dict[str, list[str]]:
    """Wraps each partitioner's ops_to_not_decompose to keep what it returned for the program
    (the first call; to_edge_transform_and_lower asks again after lowering)."""
    preserved: dict[str, list[str]] = {}
    for partitioner in partitioners:
        name = type(partitioner).__name__
        original = partitioner.ops_to_not_decompose

        def recording(ep, _original=original, _name=name):
            ops, check = _original(ep)
            preserved.setdefault(_name, sorted({str(op) for op in ops}))
            return ops, check

        partitioner.ops_to_not_decompose = recording
    return preserved


def _skip_redundant_decomposition(partitioners: list) -> None:
    """to_edge_transform_and_lower decomposes the whole program three times for a partitioner that gives a
    per-node check with its ops to preserve: once to functionalize, once keeping the ops, and once more after
    hiding the nodes that pass the check, to decompose the ones that fail it. When every such node passes,
    that third whole-graph decomposition changes nothing, at the cost of a whole decomposition. So when the check passes all of them on the functionalized program it is shown, this says "no
    check", which takes ExecuTorch's two-decomposition path; otherwise the check goes through unchanged."""
    for partitioner in partitioners:
        original = partitioner.ops_to_not_decompose

        def ops_to_not_decompose(ep, _original=original):
            ops, check = _original(ep)
            if check is None:
                return ops, check
            preserved = set(ops)
            nodes = [n for n in ep.graph.nodes if n.op == "call_function" and n.target in preserved]
            return (ops, None) if all(check(n) for n in nodes) else (ops, check)

        partitioner.ops_to_not_decompose = ops_to_not_decompose


def copy_sharing_weights(edge_program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A partition's program copied for a backend's preprocessing with its weights shared, not copied.
    ExecuTorch deep-copies every partition's program, weights included, before preprocessing
    (BackendDetails.copy_exported_program_for_preprocess), and all the copies exist at once: a second copy of
    every delegated weight. For a backend whose preprocessing only reads those tensors (it serializes them or
    builds new ones), sharing them gives the same payload; the graph and the state-dict mappings are still
    the copy's own."""
    import copy

    shared = {id(tensor): tensor for values in (edge_program.state_dict, edge_program.constants)
              for tensor in values.values() if isinstance(tensor, torch.Tensor)}
    return copy.deepcopy(edge_program, shared)


def stand_in(value: torch.Tensor) -> torch.Tensor:
    """One 0 seen through a broadcast view of value's shape, dtype and device: what a released weight becomes."""
    return torch.zeros((), dtype=value.dtype, device=value.device).expand(value.shape)


def release_weights(program: torch.export.ExportedProgram) -> None:
    """Replaces the program's parameters by stand-ins of the same shape, dtype and device that hold one element
    (a broadcast view), so what else held the weights alone is freed. For a program whose values are never read
    again; ExecuTorch still traces a delegate's source program under fake tensors while serializing, so the
    stand-ins stay on the CPU, not on the meta device. Buffers (the K/V caches that trace writes to, the small
    tables) are kept."""
    for name in program.graph_signature.parameters:
        value = program.state_dict.get(name)
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            program.state_dict[name] = (torch.nn.Parameter(stand_in(value), requires_grad=False)
                                        if isinstance(value, torch.nn.Parameter) else stand_in(value))


def release_lowered_weights(program: torch.export.ExportedProgram | dict, edge) -> None:
    """After lowering, before serializing: the program lowered and each delegated partition's source program
    give up their weights. The backends' payloads hold the weights now, and serializing reads only the
    partitions' graphs (ExecuTorch's emitter takes their debug handles and output counts)."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    for each in (program.values() if isinstance(program, dict) else [program]):
        release_weights(each)
    for method in edge.methods:
        for _, lowered, _ in get_lowered_submodules(edge.exported_program(method).graph_module):
            release_weights(lowered.original_module)


def swap_attribute(owner, name: str, new) -> Callable[[], None]:
    """Sets owner.name = new; returns what puts the original back (an inherited attribute is inherited again)."""
    had_own = name in vars(owner)
    original = vars(owner)[name] if had_own else None
    setattr(owner, name, new)
    return (lambda: setattr(owner, name, original)) if had_own else (lambda: delattr(owner, name))


def share_preprocess_weights(backend_details: type) -> Callable[[], None]:
    """`backend_details` (a BackendDetails class) preprocesses copy_sharing_weights' copies; returns the undo."""
    return swap_attribute(backend_details, "copy_exported_program_for_preprocess",
                          classmethod(lambda cls, edge_program, compile_specs: copy_sharing_weights(edge_program)))


def spill_to_files(output, spill_dir: Path, external_tag: str | None):
    """A delegate's named data (ExecuTorch's NamedDataStoreOutput: the weights its runtime looks up by key) with
    every in-memory buffer written to its own file in spill_dir and held as ExecuTorch's FileBackedData, which
    the serializer copies from disk into the output file; the file goes when nothing holds it any more.
    With external_tag, the data the .pte would carry goes to that tag's data file (`<tag>.ptd`) instead."""
    from executorch.exir._serialize._cord import FileBackedData
    from executorch.exir._serialize._named_data_store import NamedDataStoreOutput

    buffers = []
    for data in output.buffers:
        if isinstance(data, (bytes, bytearray)):
            fd, path = tempfile.mkstemp(dir=spill_dir, prefix=".named-data-", suffix=".bin")
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            data = FileBackedData(path, cleanup=True, sha256=hashlib.sha256(data).digest())
        buffers.append(data)
    pte_data, external = dict(output.pte_data), {tag: dict(entries) for tag, entries in output.external_data.items()}
    if external_tag is not None and pte_data:
        external.setdefault(external_tag, {}).update(pte_data)
        pte_data = {}
    return NamedDataStoreOutput(buffers, pte_data, external)


# While a lowering frees its weights as they are packed (free_weights_once_packed): the memory (a storage's
# address) of each weight that one delegate alone reads, which its backend's preprocessing frees once it has
# packed it (spill_named_data).
_freed_once_packed: set[int] = set()


def _storage_key(value) -> int:
    """Tensors that alias one memory (the exported program's weights and the edge program's views of them)
    share it: they are one weight. 0 for what holds no memory of its own."""
    if not isinstance(value, torch.Tensor) or value.is_meta:
        return 0
    try:
        return value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake or functional tensors own no memory
        return 0


def _sole_partition_weights(method_to_submodule_nodes: dict, method_to_tagged_program: dict) -> set[int]:
    """The memory of the weights that exactly one partition reads and the program keeps no other use of: each
    partition's program holds the constants its delegate consumes (ExecuTorch deletes them from the program
    being lowered); memory that two partitions, or the rest of the program, still read is left alone."""
    readers: Counter = Counter()
    kept: set[int] = set()
    for method, nodes in method_to_submodule_nodes.items():
        consumed = set()
        for node in nodes:
            consumed |= {spec.target for spec in node.meta["toplevel_input_specs_to_delete"].values()}
            program = node.meta["submodule_program"]
            readers.update({_storage_key(v) for v in (*program.state_dict.values(), *program.constants.values())})
        top = method_to_tagged_program[method]
        kept |= {_storage_key(value) for values in (top.state_dict, top.constants) for name, value in values.items()
                 if name not in consumed}
    return {key for key, count in readers.items() if key and count == 1 and key not in kept}


@contextmanager
def free_weights_once_packed():
    """Lowering a program whose weights nothing reads afterwards (not even the module it was exported from):
    each delegate's weights are freed as soon as its backend has packed them, instead of all waiting until the
    whole program is lowered, so the packing of the last partitions happens beside the few weights left."""
    from executorch.exir.backend import backend_api

    original = backend_api.lower_all_submodules_to_backend

    def lower_all(backend_id, method_to_submodule_nodes, method_to_tagged_program):
        _freed_once_packed.update(_sole_partition_weights(method_to_submodule_nodes, method_to_tagged_program))
        try:
            return original(backend_id, method_to_submodule_nodes, method_to_tagged_program)
        finally:
            _freed_once_packed.clear()

    backend_api.lower_all_submodules_to_backend = lower_all
    try:
        yield
    finally:
        backend_api.lower_all_submodules_to_backend = original


def _free_packed(edge_program: torch.export.ExportedProgram) -> None:
    """The partition's weights that free_weights_once_packed marked, freed: their memory is given back (every
    alias of it, the exported program's included, then holds none), and the partition's own tensors become their
    stand-ins, which the serializer may still trace."""
    for value in (*edge_program.state_dict.values(), *edge_program.constants.values()):
        key = _storage_key(value)
        if key in _freed_once_packed:
            _freed_once_packed.discard(key)
            memory = value.untyped_storage()
            with torch.no_grad():
                value.set_(stand_in(value))
            memory.resize_(0)


def spill_named_data(backend_details: type, spill_dir: Path, external_tag: str | None) -> Callable[[], None]:
    """`backend_details` (a BackendDetails class whose preprocess puts its weights in ExecuTorch's named data
    store) hands each delegate's weights to files as soon as that delegate is packed (spill_to_files), so no
    packed copy of the model waits in memory for the .pte to be written; under free_weights_once_packed the
    weights it packed are freed then too. Returns the undo."""
    original = backend_details.preprocess

    def preprocess(edge_program, compile_specs):
        result = original(edge_program, compile_specs)
        _free_packed(edge_program)
        if result.data_store_output is not None:
            try:
                result.data_store_output = spill_to_files(result.data_store_output, spill_dir, external_tag)
            except OSError as err:  # a full disk is the output's failure, said as such, not the backend's
                raise OutputWriteError(err.errno, err.strerror, str(spill_dir)) from err
        return result

    return swap_attribute(backend_details, "preprocess", staticmethod(preprocess))


def write_data_file(executorch_program, ptd_path: Path) -> tuple[int, str]:
    """The program's one data file (its .ptd), written atomically: (size, sha256)."""
    # ExecutorchProgramManager.write_tensor_data_to_file writes in place under its own names; its pieces are the
    # same Cords, written here through write_atomically.
    files = executorch_program._tensor_data or {}
    if set(files) != {data_file_tag(ptd_path)}:
        raise RuntimeError(f"expected one data file {data_file_tag(ptd_path)!r}, ExecuTorch made {sorted(files)}")
    try:
        return write_atomically(ptd_path, files[data_file_tag(ptd_path)].write_to_file)
    except OSError as err:
        raise OutputWriteError(err.errno, err.strerror, str(ptd_path)) from err


def data_file_tag(ptd_path: Path) -> str:
    """ExecuTorch names each data file after its tag: <tag>.ptd."""
    return Path(ptd_path).stem


def export_program(module: torch.nn.Module, max_seq_len: int, strict: bool = True) -> torch.export.ExportedProgram:
    """One program for prefill and decode: the token dimension is dynamic (1 .. max_seq_len, or the fewer tokens
    per call the module's options say: a longer prompt then goes in several calls).
    strict: the backend's export mode (Backend.strict_export). Non-strict export is faster, but not every
    module form gives the same program through it: non-strict tracing of the sdpa-slice cache write with
    grouped KV heads adds a guard that refuses seq_len == max_seq_len."""
    options = getattr(module, "options", None)
    tokens = min(max_seq_len, options.call_tokens) if options is not None else max_seq_len
    example = (torch.zeros((1, 2), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
    seq = torch.export.Dim("seq_len", min=1, max=tokens)
    with collector_skipping_older_objects():
        return torch_export.export(module, example, dynamic_shapes=({1: seq}, None), strict=strict)


@dataclass(frozen=True)
class Lowering:
    """How one program is lowered, beyond its partitioners.

    transform_passes, compile_config: the backend's edge passes and compile config (lower_for_backend fills them).
    lowering_context: the backend's (Backend.lowering_context), entered around to_edge_transform_and_lower
    and to_executorch and left before lowering returns. constant_methods: methods that return a constant
    (recipes.lowering.llm_metadata), kept in the .pte. before_serialize: called with the lowered EdgeProgramManager
    before to_executorch (e.g. ExecuTorch's strip_taps_ for a program with intermediate-output taps).
    generate_etrecord: also ExecuTorch's ETRecord of the program, for its devtools.
    pte_path: write the .pte there (atomically) from ExecuTorch's pieces, never holding it as one contiguous
    `bytes` beside them, which would cost a second copy of the program at its peak; without it the
    LoweredProgram holds the bytes.
    consume_program: the caller will not use `program` again, so its weights are released once lowered
    (release_lowered_weights): a weight nothing else holds (the module it was exported from, say) is then not
    in memory while the .pte is written. Not with an ETRecord, which serializes the partitions' programs.
    ptd_path: write the delegates' weights there, an ExecuTorch data file beside the .pte, instead of into it.
    named_data_context: the backend's (Backend.named_data_context); with it and a pte_path, each delegate's
    weights go to files in a scratch folder beside the .pte as soon as it is packed, and from there into the
    .pte or the .ptd.
    free_weights_as_packed: with consume_program, nothing at all reads the program's weights after lowering (no
    module it was exported from is kept either): under a named_data_context each delegate's weights are freed as
    soon as it is packed (free_weights_once_packed)."""
    transform_passes: list | None = None
    compile_config: object = None
    lowering_context: Callable[[], ContextManager] = contextlib.nullcontext
    constant_methods: dict | None = None
    before_serialize: Callable | None = None
    generate_etrecord: bool = False
    pte_path: Path | None = None
    consume_program: bool = False
    ptd_path: Path | None = None
    named_data_context: Callable[[Path, str | None], ContextManager] | None = None
    free_weights_as_packed: bool = False
    # The methods' inputs and outputs live in buffers the runner allocates and sets (a runner that keeps the KV
    # caches and passes them to each call): the program plans no memory for them.
    caller_allocates_io: bool = False


def lower_to_pte(program: torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram], partitioners: list,
                 lowering: Lowering = Lowering()) -> LoweredProgram:
    """program: one ExportedProgram (the .pte's `forward`), or {method name: ExportedProgram} for a .pte of
    several methods (a static recipe's prefill and decode), lowered together so a backend may share their weights."""
    how = lowering
    if how.ptd_path is not None and (how.named_data_context is None or how.pte_path is None):
        raise ValueError("a .ptd needs a backend that keeps its weights in ExecuTorch's named data, and a pte_path")
    # after the collector's freeze ends: frozen objects are invisible to gc.get_objects(), which the release reads
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(collector_skipping_older_objects())
            stack.enter_context(how.lowering_context())
            if how.named_data_context is not None and how.pte_path is not None:
                Path(how.pte_path).parent.mkdir(parents=True, exist_ok=True)
                spill_dir = stack.enter_context(tempfile.TemporaryDirectory(dir=Path(how.pte_path).parent,
                                                                            prefix=".named-data-"))
                stack.enter_context(how.named_data_context(Path(spill_dir),
                                                           data_file_tag(how.ptd_path) if how.ptd_path else None))
                if how.free_weights_as_packed and how.consume_program and not how.generate_etrecord:
                    stack.enter_context(free_weights_once_packed())
            return _lower(program, partitioners, how)
    finally:
        _release_cached_programs()


def _lower(program, partitioners: list, how: Lowering) -> LoweredProgram:
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower

    pte_path, ptd_path = how.pte_path, how.ptd_path

    counter = _EdgeOpCounter()
    _skip_redundant_decomposition(partitioners)
    preserved = _record_preserved_ops(partitioners)
    rss.mark()
    start = time.perf_counter()
    try:
        with _capture_partitioner_logs() as reasons:
            edge = to_edge_transform_and_lower(
                program,
                partitioner=partitioners,
                transform_passes=[*(how.transform_passes or []), counter],
                constant_methods=how.constant_methods,
                compile_config=how.compile_config,
                generate_etrecord=how.generate_etrecord,
            )
    finally:
        for partitioner in partitioners:
            partitioner.__dict__.pop("ops_to_not_decompose", None)
    lower_s = time.perf_counter() - start
    lower_peak = rss.peak_bytes() / rss.MB
    # Read before to_executorch, which rewrites the same graphs (alloc nodes, out variants) in place.
    delegation = methods_delegation_table({name: edge.exported_program(name).graph_module for name in sorted(edge.methods)},
                                          ops_before_partitioning=dict(counter.counts), preserved_ops=preserved,
                                          partitioner_reasons=reasons)
    if how.before_serialize is not None:
        how.before_serialize(edge)
    if how.consume_program and not how.generate_etrecord:
        release_lowered_weights(program, edge)
    malloc_policy.trim_freed_heap()
    rss.mark()
    start = time.perf_counter()
    # Quant fusion turns torchao's dequantize_affine + embedding into ExecuTorch's quantized
    # embedding kernels; without it the leftover dequantize_affine has no out variant.
    planning = {}
    if how.caller_allocates_io:
        from executorch.exir.passes import MemoryPlanningPass

        planning["memory_planning_pass"] = MemoryPlanningPass(alloc_graph_input=False, alloc_graph_output=False)
    executorch_program = edge.to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True, **planning))
    if pte_path is None:
        pte = executorch_program.buffer  # joins the pieces into one bytes object, cached by the manager
        size, digest = len(pte), hashlib.sha256(pte).hexdigest()
    else:
        pte = None
        try:
            size, digest = write_atomically(pte_path, executorch_program.write_to_file)
        except OSError as err:
            raise OutputWriteError(err.errno, err.strerror, str(pte_path)) from err
    ptd = (None, 0, "")
    if ptd_path is not None:
        ptd = (Path(ptd_path), *write_data_file(executorch_program, ptd_path))
    etrecord = None
    if how.generate_etrecord:
        buffer = io.BytesIO()
        executorch_program.get_etrecord().save(buffer)
        etrecord = buffer.getvalue()
    serialize_s = time.perf_counter() - start
    return LoweredProgram(
        pte, delegation, sum(counter.counts.values()), lower_s, serialize_s,
        round(lower_peak, 1), round(rss.peak_bytes() / rss.MB, 1), etrecord,
        Path(pte_path) if pte_path is not None else None, size, digest, *ptd,
    )


def lower_for_backend(program: torch.export.ExportedProgram, recipe, options: dict,
                      lowering: Lowering = Lowering()) -> LoweredProgram:
    """lower_to_pte with what the recipe's backend (a recipes.registry.Recipe's) adds for these recipe options:
    its partitioners, its edge compile config, its transform passes, its lowering and named-data contexts."""
    backend = recipe.backend
    return lower_to_pte(program, recipe.make_partitioners(options), dataclasses.replace(
        lowering,
        transform_passes=backend.transform_passes(recipe.quantization, options) if backend.transform_passes else None,
        compile_config=backend.edge_compile_config() if backend.edge_compile_config else None,
        lowering_context=backend.lowering_context,
        named_data_context=backend.named_data_context,
    ))
