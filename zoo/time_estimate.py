"""How long a job will take, from rates fitted to the zoo's measured cells (zoo/results.json).

A recipe's run has three measured parts: export, lowering, and the rest (loading, quantizing and writing; in a
full job also the generations, fidelity and profile). Each part's seconds are fitted as a power law of the model's
parameters, seconds = scale * (parameters / 1e9) ** exponent, on the cells most like the recipe: the same backend
and scheme (for the rest also the same quantization algorithm and job kind, export-only or full), widening to the
backend's cells, then to every cell, where fewer than two model sizes were measured. Within a group the cells of
the newest ExecuTorch are used when they span two sizes. The fit is made once per results file."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path

from recipes.memory_estimate import parameter_count
from recipes.registry import load_backends
from zoo.entries import ZOO_DIR, executorch_version, load_entries, read_results

RESULTS = ZOO_DIR / "results.json"
PARTS = ("export", "lower", "other")
# What a part's seconds depend on, from the narrowest group of cells to the widest.
GROUPINGS = {
    "export": (("backend", "scheme"), ("backend",), ()),
    "lower": (("backend", "scheme"), ("backend",), ()),
    "other": (("backend", "scheme", "algorithm", "export_only"), ("backend", "scheme", "export_only"),
              ("backend", "export_only"), ("export_only",)),
}
MIN_SECONDS = 1.0  # a part measured as less (rounding, or parts summed past the total) counts as this
# Seconds a calibration search adds per 1e9 parameters on a 2-core host, for algorithms no zoo cell recorded (the
# cells' quantizing has no search in it): AWQ's at Llama-3.2-1B's shape, export-only (docs/quantization.md).
SEARCH_S_PER_BILLION = {"awq": 28.0, "awq-gptq": 28.0}


@dataclass(frozen=True)
class Sample:
    """One measured cell, reduced to what the fit reads."""

    backend: str
    scheme: str
    algorithm: str | None  # as recorded by the matrix; None where the cell does not say
    export_only: bool
    params: int
    executorch: tuple[int, ...]
    seconds: dict  # part -> seconds
    cores: int | None = None


@dataclass(frozen=True)
class Fit:
    scale_s: float  # seconds at 1e9 parameters
    exponent: float
    cells: int
    smallest: int  # parameters of the smallest and largest model it was fitted on
    largest: int
    group: tuple  # the grouping's values, e.g. ("xnnpack", "8da4w")
    cores: tuple[int, ...] = ()

    def seconds(self, params: int) -> float:
        return self.scale_s * (params / 1e9) ** self.exponent


@dataclass(frozen=True)
class RecipeTime:
    recipe: str
    seconds: dict  # part -> seconds
    fits: dict  # part -> Fit

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


@dataclass(frozen=True)
class JobTime:
    seconds: float
    recipes: list[RecipeTime]
    smallest: int  # the parameter range of every cell behind the estimate
    largest: int
    cores: tuple[int, ...]  # the cores of the hosts those cells ran on
    notes: list[str] = field(default_factory=list)  # where the estimate leaves what the cells measured


def size_label(params: int) -> str:
    """1.2B, 134M, 27K: parameters as model names give them."""
    if params >= 1e9:
        return f"{params / 1e9:.1f}B"
    if params >= 1e6:
        return f"{params / 1e6:.0f}M"
    return f"{params / 1e3:.0f}K"


def duration_label(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def samples(path: Path = RESULTS) -> list[Sample]:
    """The finished cells with their three parts' seconds, read once per version of the results file."""
    path = Path(path)
    return list(_samples(str(path), path.stat().st_mtime_ns if path.is_file() else 0))


@functools.lru_cache(maxsize=4)
def _samples(path: str, _mtime_ns: int) -> tuple[Sample, ...]:
    recipes = load_backends().recipes
    entries = load_entries()
    found = []
    for cell in read_results(Path(path)):
        timed = all(isinstance(cell.get(key), (int, float)) for key in ("export_s", "lower_s", "seconds"))
        if cell.get("status") != "ok" or not timed or cell["recipe"] not in recipes:
            continue
        params = cell.get("params")
        if params is None and cell["model"] in entries:
            params = parameter_count(entries[cell["model"]].llama_config())
        if not params:
            continue
        other = cell["seconds"] - cell["export_s"] - cell["lower_s"]
        found.append(Sample(
            backend=cell["backend"], scheme=recipes[cell["recipe"]].quantization,
            algorithm=cell.get("quant_algorithm") or (cell.get("options") or {}).get("quant_algorithm"),
            export_only=bool(cell.get("export_only")), params=int(params), executorch=executorch_version(cell),
            seconds={part: max(MIN_SECONDS, value) for part, value in
                     (("export", cell["export_s"]), ("lower", cell["lower_s"]), ("other", other))},
            cores=cell.get("cores"),
        ))
    return tuple(found)


def fit_power_law(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(scale at 1e9 parameters, exponent) by least squares on the logarithms, so every cell's error counts
    relative to its own time. The exponent is kept at 0 or above: a bigger model never takes less time."""
    xs = [math.log(params / 1e9) for params, _ in points]
    ys = [math.log(seconds) for _, seconds in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    exponent = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    exponent = max(0.0, exponent)
    return math.exp(sum(y - exponent * x for x, y in zip(xs, ys)) / len(xs)), exponent


def _fit(cells: list[Sample], part: str, group: tuple) -> Fit | None:
    """The part's fit on these cells, or None when they measured fewer than two model sizes."""
    newest = max(c.executorch for c in cells) if cells else ()
    for chosen in ([c for c in cells if c.executorch == newest], cells):
        if len({c.params for c in chosen}) >= 2:
            scale, exponent = fit_power_law([(c.params, c.seconds[part]) for c in chosen])
            return Fit(scale, exponent, len(chosen), min(c.params for c in chosen), max(c.params for c in chosen),
                       group, tuple(sorted({c.cores for c in chosen if c.cores})))
    return None


def part_fit(part: str, backend: str, scheme: str, algorithm: str | None, export_only: bool,
             path: Path = RESULTS) -> Fit:
    """The fit of one part for a recipe like this, from the narrowest group of cells that measured two sizes."""
    path = Path(path)
    return _part_fit(part, backend, scheme, algorithm, export_only, str(path),
                     path.stat().st_mtime_ns if path.is_file() else 0)


@functools.lru_cache(maxsize=256)
def _part_fit(part: str, backend: str, scheme: str, algorithm: str | None, export_only: bool, path: str,
              mtime_ns: int) -> Fit:
    wanted = {"backend": backend, "scheme": scheme, "algorithm": algorithm, "export_only": export_only}
    cells = _samples(path, mtime_ns)
    for grouping in GROUPINGS[part]:
        chosen = [c for c in cells if all(getattr(c, key) == wanted[key] for key in grouping)]
        fit = _fit(chosen, part, tuple(wanted[key] for key in grouping))
        if fit is not None:
            return fit
    raise ValueError(f"{path} has fewer than two model sizes measured; the time estimate needs more cells.")


def estimate_time(params: int, recipes: list, options: dict, generate: bool, path: Path = RESULTS) -> JobTime:
    """Seconds of running `recipes` (registry Recipes, one after another) on a model of `params` parameters.
    options: recipe name -> its options (the algorithm among them)."""
    per_recipe, notes = [], []
    for recipe in recipes:
        recipe_options = options.get(recipe.name, {})
        algorithm = recipe_options.get("quant_algorithm")
        fits = {part: part_fit(part, recipe.backend.name, recipe.quantization, algorithm, not generate, path)
                for part in PARTS}
        seconds = {part: fit.seconds(params) for part, fit in fits.items()}
        search_s = 0.0
        if algorithm in SEARCH_S_PER_BILLION and "algorithm" not in _grouping_of(fits["other"]):
            search_s = SEARCH_S_PER_BILLION[algorithm] * params / 1e9
            seconds["other"] += search_s
        per_recipe.append(RecipeTime(recipe.name, seconds, fits))
        notes += _notes(recipe, algorithm, recipe_options, fits, search_s)
    used = [fit for r in per_recipe for fit in r.fits.values()]
    smallest, largest = min(f.smallest for f in used), max(f.largest for f in used)
    if not smallest <= params <= largest:
        notes.append(f"a {size_label(params)} model is outside the {size_label(smallest)}–{size_label(largest)} "
                     "the cells measured: extrapolated")
    return JobTime(sum(r.total_s for r in per_recipe), per_recipe, smallest, largest,
                   tuple(sorted({c for f in used for c in f.cores})), list(dict.fromkeys(notes)))


def _notes(recipe, algorithm: str | None, options: dict, fits: dict, search_s: float = 0.0) -> list[str]:
    notes = []
    if not fits["lower"].group:
        notes.append(f"no zoo cell measured {recipe.backend.name}: {recipe.name} is timed from every backend's cells")
    elif len(fits["lower"].group) == 1:
        notes.append(f"no zoo cell measured {recipe.quantization} on {recipe.backend.name}: {recipe.name} is timed "
                     f"from its backend's other recipes")
    if algorithm and "algorithm" not in _grouping_of(fits["other"]):
        notes.append(f"no zoo cell records the {algorithm} algorithm for {recipe.quantization}: its quantize time "
                     "is that of the cells whose algorithm was not recorded"
                     + (f", plus {duration_label(search_s)} of {algorithm}'s calibration search at its measured rate"
                        if search_s else ""))
    if options.get("mixed_precision_budget"):
        notes.append("no zoo cell measured a mixed-precision search, which adds minutes to quantizing")
    return notes


def _grouping_of(fit: Fit) -> tuple:
    return next(g for g in GROUPINGS["other"] if len(g) == len(fit.group))
