"""The recipe registry. A backend file in recipes/ registers its recipes here by name; the pipeline
only ever looks recipes up, so it never branches on backend names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from errors import UserFacingError


@dataclass(frozen=True)
class Recipe:
    name: str
    backend: str
    quantization: str  # a scheme name from quant.schemes
    description: str
    partitioners: Callable[[dict], list]  # (recipe options) -> partitioner instances
    attention: str = "custom"  # models.llama.ExportOptions.attention
    dtype: torch.dtype = torch.float32
    # Why the .pte cannot run here, or None when it can; checked before generating.
    cannot_run_here: Callable[[], str | None] = lambda: None
    # Loads the runtime kernels/ops the .pte needs (ExecuTorch resolves ops at load_method time).
    runtime_imports: tuple[str, ...] = ()
    edge_compile_config: Callable[[], object] | None = None
    transform_passes: Callable[[], list] | None = None
    options: dict = field(default_factory=dict)  # defaults of recipe options (group size, SoC, ...)
    # Engine label of the eager generation shown when the .pte cannot run here (or failed to lower).
    eager_engine: str = "eager-quantized"
    # For recipes/memory_estimate.py: the peak RSS lowering adds, per byte of the .pte it makes; bytes per
    # weight (linears, embedding) of the .pte when the backend stores weights otherwise than the scheme says;
    # the peak of a PT2E quantization (observers, converted copy) per byte of the float module.
    lowering_memory_ratio: float = 2.0
    pte_bytes: tuple[float, float] | None = None
    pt2e_memory_ratio: float = 3.0


RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    if recipe.name in RECIPES:
        raise ValueError(f"recipe {recipe.name!r} registered twice")
    RECIPES[recipe.name] = recipe
    return recipe


def load_backends() -> None:
    """Import every backend file so it registers; a backend that cannot even import is skipped
    (its recipes are then absent, and `list` says why)."""
    import importlib

    for module in ("recipes.xnnpack", "recipes.coreml", "recipes.qnn"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


def get_recipe(name: str) -> Recipe:
    load_backends()
    if name not in RECIPES:
        raise UserFacingError(f"unknown recipe {name!r}; choose one of: {', '.join(sorted(RECIPES))}.")
    return RECIPES[name]
