"""The backend registry. Each backend is one module of recipes/backends/ that defines `BACKEND` (a Backend) and
`RECIPES` (its Recipes); load_backends() finds them by importing every module of that package and of the
packages named in LOWERBENCH_BACKEND_PACKAGES. The pipeline asks a recipe's backend everything it needs, so it never
branches on backend names."""
from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

from models.errors import UserFacingError
from models.llama import ExportOptions
from quant.schemes import SCHEMES

BACKENDS_PACKAGE = "recipes.backends"
BACKEND_PACKAGES_ENV = "LOWERBENCH_BACKEND_PACKAGES"  # comma-separated importable packages of extra backends


def _describes_nothing(options: dict) -> dict:
    return {}


@dataclass(frozen=True, eq=False)
class Backend:
    name: str  # lower case, the first part of its recipes' names
    title: str  # its name for people
    delegate_id: str  # the runtime's id of its delegate in a .pte (its BackendDetails class name)
    runs_on: str  # one line: where its .pte runs
    partitioners: Callable[[dict], list]  # (recipe options) -> partitioner instances
    schemes: tuple[str, ...]  # names in quant.schemes.SCHEMES it lowers correctly
    refused: dict[str, str] = field(default_factory=dict)  # scheme -> why not (a scheme someone would expect)
    # Why its .pte cannot run on this host, or None when it can; checked before generating.
    cannot_run_here: Callable[[], str | None] = lambda: None
    # The module form it delegates best (models.llama.ExportOptions).
    attention: str = "sdpa"
    norm: str = "hf"
    fuse_qkv: bool = False
    static_tokens: int | None = None  # a backend that compiles static shapes: tokens per call
    strict_export: bool = True
    # Recipe options every recipe of this backend takes, with their defaults for a recipe (e.g. its KV cache's dtype).
    option_defaults: Callable[["Recipe"], dict] = lambda recipe: {}
    # (recipe options, the module form so far as ExportOptions fields) -> the fields those options set.
    module_options: Callable[[dict, dict], dict] = lambda options, form: {}
    # Modules that load the runtime kernels/ops its .pte needs (ExecuTorch resolves ops at load_method time).
    runtime_imports: tuple[str, ...] = ()
    # Engine label of the eager generation shown when its .pte cannot run here (or failed to lower).
    eager_engine: str = "eager-quantized"
    edge_compile_config: Callable[[], object] | None = None
    # (scheme, recipe options) -> the passes to_edge_transform_and_lower runs on the edge program.
    transform_passes: Callable[[str, dict], list] | None = None
    # Entered around the lowering: e.g. its version-guarded dependency patches, restored on exit.
    lowering_context: Callable[[], ContextManager] = contextlib.nullcontext
    # For a backend whose delegates keep their weights in ExecuTorch's named data store: (scratch folder, the
    # .ptd's tag or None) -> a context, entered around the lowering, that spills each delegate's weights to files
    # in that folder as it is packed, tagged for the .ptd when one is asked for. None: it can write no .ptd.
    named_data_context: Callable[[Path, str | None], ContextManager] | None = None
    # What the report records about the compile target of these options (e.g. a SoC and its libraries).
    describe_options: Callable[[dict], dict] = _describes_nothing
    # Raises UserFacingError for recipe options it cannot take, before any weight is read.
    check_options: Callable[[dict], None] = lambda options: None
    # Python packages its lowering needs besides torch/executorch/torchao, recorded in every report.
    packages: tuple[str, ...] = ()
    # PT2E schemes: (scheme, options, module to annotate) -> the quantizer, and the passes its
    # quantized program gets before lowering (ExportedProgram, scheme) -> ExportedProgram.
    pt2e_quantizer: Callable | None = None
    pt2e_program_passes: Callable | None = None
    # (recipe options, context) -> {method name: tokens per call}, prefill first, for a PT2E program of a prefill and
    # a decode method with the KV caches as inputs and outputs (models/kv_io_llama.py,
    # recipes/lowering/kv_io_program.py); None: one method.
    kv_io_methods: Callable[[dict, int], dict[str, int] | None] = lambda options, context: None
    # For recipes/estimates/memory_estimate.py: the peak RSS its lowering adds per byte of the .pte it makes, over a
    # base its converter takes whatever the model's size, and the peak of a PT2E quantization (observers,
    # converted copy) per byte of the float module.
    lowering_memory_ratio: float = 2.0
    lowering_memory_base_bytes: float = 0.0
    # Instead of the ratio, where a converter's working set follows the weights rather than the .pte: bytes per
    # weight of the decoder's linears, and per weight of the embedding and the output layer.
    lowering_memory_per_weight: tuple[float, float] | None = None
    # Over either: what lowering holds per decoder layer whatever its width (each layer's partition: its copied
    # graph and its delegate's serialized graph), which is most of a small model's lowering.
    lowering_memory_per_layer_bytes: float = 0.0
    # (recipe options) -> how many decoder layers one compile holds at a time, for a backend that compiles the
    # decoder in shards (its ratio then counts the weights of the largest shard, not the whole .pte); None: all.
    layers_compiled_at_once: Callable[[dict], int | None] = lambda options: None
    # A program of several methods (a static recipe's prefill and decode): what each method after the first adds to
    # the lowering's working set above, as a fraction of it.
    lowering_memory_per_method: float = 1.0
    pt2e_memory_ratio: float = 3.0
    # Serializing: the program's flatbuffer pieces and what the lowered program still holds, per byte of the .pte.
    serialize_memory_ratio: float = 2.1


@dataclass(frozen=True)
class Recipe:
    name: str
    backend: Backend
    quantization: str  # a scheme name from quant.schemes
    description: str
    options: dict = field(default_factory=dict)  # defaults of recipe options (group size, SoC, ...)
    module_overrides: dict = field(default_factory=dict)  # ExportOptions fields that differ from the backend's
    partitioners: Callable[[dict], list] | None = None  # instead of the backend's (e.g. another precision)
    # Bytes per weight (linears, embedding) of the .pte where the backend stores weights otherwise than the
    # scheme says (recipes/estimates/memory_estimate.py).
    pte_bytes: tuple[float, float] | None = None
    # Where this recipe's lowering differs from the backend's `lowering_memory_ratio` (same units).
    lowering_memory_ratio: float | None = None
    default: bool = False  # ticked when the app opens
    # Static shapes, caches and masks as inputs and outputs (models/static_llama.py): the .pte has `forward` (decode)
    # and `prefill` methods in ExecuTorch's static layout (recipes/lowering/static_program.py) and ships
    # run_static.py; its options give prefill_chunk and max_linear_outputs.
    static_io: bool = False

    def export_options(self, max_seq_len: int, options: dict | None = None) -> ExportOptions:
        """The module form for these recipe options (recipes/pipeline/run.py: recipe_options; None: the defaults)."""
        backend = self.backend
        form = dict(attention=backend.attention, norm=backend.norm, fuse_qkv=backend.fuse_qkv,
                    dtype=SCHEMES[self.quantization].module_dtype)
        form = {**form, **self.module_overrides}
        chosen = {**backend.option_defaults(self), **self.options, **(options or {})}
        return ExportOptions(max_seq_len, **{**form, **backend.module_options(chosen, form)})

    def make_partitioners(self, options: dict) -> list:
        return (self.partitioners or self.backend.partitioners)(options)


def recipe(backend: Backend, quantization: str, description: str, name: str | None = None, **fields) -> Recipe:
    """`<backend>-<scheme>` unless named otherwise."""
    return Recipe(name or f"{backend.name}-{quantization}", backend, quantization, description, **fields)


@dataclass
class Registry:
    backends: dict[str, Backend] = field(default_factory=dict)
    recipes: dict[str, Recipe] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)  # module -> why it did not import
    packages: tuple[str, ...] | None = None  # the packages it was loaded from


REGISTRY = Registry()
RECIPES = REGISTRY.recipes


def _backend_packages() -> tuple[str, ...]:
    return (BACKENDS_PACKAGE, *filter(None, (p.strip() for p in os.environ.get(BACKEND_PACKAGES_ENV, "").split(","))))


def _backend_modules(packages: tuple[str, ...]) -> list[str]:
    modules = []
    for package in packages:
        try:
            found = importlib.import_module(package)
        except ModuleNotFoundError as err:
            raise UserFacingError(
                f"{BACKEND_PACKAGES_ENV} names {package!r}, which does not import ({err}); "
                "give importable package names, comma-separated."
            ) from err
        modules += [f"{package}.{m.name}" for m in pkgutil.iter_modules(found.__path__) if not m.name.startswith("_")]
    return modules


def register(module) -> None:
    backend, recipes = getattr(module, "BACKEND", None), getattr(module, "RECIPES", ())
    if backend is None:
        return
    if backend.name in REGISTRY.backends and REGISTRY.backends[backend.name] is not backend:
        raise ValueError(f"backend {backend.name!r} defined twice ({module.__name__})")
    REGISTRY.backends[backend.name] = backend
    for entry in recipes:
        if entry.name in RECIPES and RECIPES[entry.name] is not entry:
            raise ValueError(f"recipe {entry.name!r} registered twice")
        if entry.quantization not in backend.schemes:
            raise ValueError(f"recipe {entry.name!r}: {backend.name} does not take {entry.quantization}")
        RECIPES[entry.name] = entry


def load_backends() -> Registry:
    """Imports every backend module (again when LOWERBENCH_BACKEND_PACKAGES changed); one whose optional
    package is missing is listed as unavailable."""
    packages = _backend_packages()
    if REGISTRY.packages != packages:
        for table in (REGISTRY.backends, REGISTRY.recipes, REGISTRY.unavailable):
            table.clear()  # in place: RECIPES is this same dict
        for name in _backend_modules(packages):
            try:
                register(importlib.import_module(name))
            except ImportError as err:
                REGISTRY.unavailable[name] = f"{type(err).__name__}: {err}"
        # The backends whose .pte runs on this host first, then by name.
        ordered = sorted(REGISTRY.backends.values(), key=lambda b: (b.cannot_run_here() is not None, b.name))
        REGISTRY.backends.clear()
        REGISTRY.backends.update((b.name, b) for b in ordered)
        REGISTRY.packages = packages
    return REGISTRY


def backend_packages() -> list[str]:
    """The Python packages the backends' lowerings need besides torch, executorch and torchao (a report's
    versions name them)."""
    return list(dict.fromkeys(package for backend in load_backends().backends.values() for package in backend.packages))


def backend_for_delegate(delegate_id: str) -> Backend | None:
    return next((b for b in load_backends().backends.values() if b.delegate_id == delegate_id), None)


def check_scheme(backend: Backend, scheme: str) -> None:
    if scheme in backend.schemes:
        return
    why = backend.refused.get(scheme)
    raise UserFacingError(
        f"{backend.name} does not take the {scheme} scheme" + (f" ({why})" if why else "")
        + f"; {backend.name} takes: {', '.join(backend.schemes)}."
    )


def get_recipe(name: str) -> Recipe:
    """The one place recipe names are checked. A name that reads as `<backend>-<known scheme>` is refused with
    the schemes that backend takes, rather than as an unknown name."""
    registry = load_backends()
    if name in RECIPES:
        return RECIPES[name]
    for backend in registry.backends.values():
        scheme = name[len(backend.name) + 1:] if name.startswith(backend.name + "-") else None
        if scheme in SCHEMES or scheme in backend.refused:
            check_scheme(backend, scheme)
            names = sorted(r.name for r in RECIPES.values() if r.backend is backend)
            raise UserFacingError(f"unknown recipe {name!r}; {backend.name} recipes: {', '.join(names)}.")
    raise UserFacingError(f"unknown recipe {name!r}; choose one of: {', '.join(sorted(RECIPES))}.")


def compatibility_table() -> str:
    """Backend x scheme grid for `python -m recipes list`: `yes`, or `-` with the reason below."""
    backends = list(load_backends().backends.values())
    schemes = list(SCHEMES)
    width = max(len(s) for s in schemes) + 2
    column = max([9, *(len(b.name) + 2 for b in backends)])
    lines = [(f"{'scheme':<{width}}" + "".join(f"{b.name:<{column}}" for b in backends)).rstrip()]
    for scheme in schemes:
        cells = "".join(f"{'yes' if scheme in b.schemes else '-':<{column}}" for b in backends)
        lines.append(f"{scheme:<{width}}{cells}".rstrip())
    lines += [f"  {b.name} + {scheme}: {why}" for b in backends for scheme, why in b.refused.items()]
    return "\n".join(lines)

