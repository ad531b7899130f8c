"""How long a job will take, stage by stage, from the zoo's measured cells (passed in as data: the path of a
results.json, by default the zoo's own, or its cells as a list of their JSON objects).

A cell is one recipe's job on one model, measured alone on its host, with each stage's seconds (its report's
timings) and its host's speed (recipes/estimates/host_speed.py). A stage's seconds are fitted as a power law of the model's
parameters, seconds = scale * (parameters / 1e9) ** exponent, on the cells most like the recipe (the same backend
and scheme, and for quantizing the same algorithm), widening to the backend's cells, then to every cell, where
fewer than two model sizes were measured (a narrower group measured at one size keeps its level there and borrows
only the slope). Seconds are fitted at the cells' speed and scaled to this host's: the
Python-bound stages by the Python probe, the others by the matmul probe. The stages every recipe of a job shares
(loading, the fp32 reference) are counted once per job."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from recipes.estimates.host_speed import HostSpeed
from recipes.output.report import TimeEstimate

ZOO_RESULTS = Path(__file__).resolve().parents[2] / "zoo" / "results.json"
# The job's stages (a report's timings_s keys), and what each stage's seconds depend on, narrowest first.
SHARED_STAGES = ("load", "reference_generation", "reference_fidelity")
RECIPE_STAGES = ("quantize", "export", "lower", "serialize", "generate", "fidelity", "runner_generate", "profile")
FULL_JOB_ONLY = ("reference_generation", "reference_fidelity", "generate", "fidelity", "runner_generate",
                 "profile")
GROUPINGS = {
    "load": ((),),
    "reference_generation": ((),),
    "reference_fidelity": ((),),
    "quantize": (("scheme", "algorithm"), ("scheme",), ()),
    "export": (("backend", "scheme"), ("backend",), ()),
    "lower": (("backend", "scheme"), ("backend",), ()),
    "serialize": (("backend",), ()),
    "generate": (("backend", "scheme"), ("backend",), ()),
    "fidelity": (("backend", "scheme"), ("backend",), ()),
    "runner_generate": (("backend",), ()),
    "profile": (("backend",), ()),
}
# Graph passes written in Python: their seconds follow the Python probe; every other stage's the matmul probe.
PYTHON_STAGES = ("load", "export", "lower", "serialize")
# The parts the report and the app show an estimate in.
PARTS = {"export": ("export",), "lower": ("lower", "serialize")}


@dataclass(frozen=True)
class Sample:
    """One measured cell, reduced to what the fit reads."""

    backend: str
    scheme: str
    algorithm: str | None
    export_only: bool
    params: int
    seconds: dict  # stage -> seconds, as measured
    speed: HostSpeed
    cpu: str
    cores: int | None = None
    date: str = ""


@dataclass(frozen=True)
class Fit:
    scale: float  # seconds at 1e9 parameters on a host of unit speed
    exponent: float
    cells: int
    smallest: int  # parameters of the smallest and largest model it was fitted on
    largest: int
    group: tuple  # the grouping's values, e.g. ("xnnpack", "8da4w")

    def seconds(self, params: int, speed: float) -> float:
        return self.scale * (params / 1e9) ** self.exponent / speed


def _part(seconds: dict, name: str) -> float:
    """export, lower (with serializing) or other (the rest of the recipe's own stages) of a recipe's seconds."""
    if name in PARTS:
        return sum(seconds.get(stage, 0.0) for stage in PARTS[name])
    named = {stage for stages in PARTS.values() for stage in stages}
    return sum(value for stage, value in seconds.items() if stage not in named)


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


def _version(path: Path) -> tuple[str, int]:
    """The results file and its modification time: what the cached reading and fits are keyed by, so a file
    written anew is read again."""
    return str(path), path.stat().st_mtime_ns if path.is_file() else 0


@functools.lru_cache(maxsize=4)
def _samples(path: str, _mtime_ns: int) -> tuple[Sample, ...]:
    return samples_of(json.loads(Path(path).read_text())["cells"] if Path(path).is_file() else [])


def samples_of(cells: list[dict]) -> tuple[Sample, ...]:
    """The finished cells (results.json's JSON objects) that measured their stages alone."""
    from recipes.registry import load_backends  # loads torch: zoo/matrix.py imports this module torch-free

    recipes = load_backends().recipes
    found = []
    for cell in cells:
        speed = HostSpeed.from_dict(cell.get("host_speed"))
        if (cell.get("status") != "ok" or not cell.get("alone") or not cell.get("stages_s") or speed is None
                or cell["recipe"] not in recipes or not cell.get("params")):
            continue
        found.append(Sample(backend=cell["backend"], scheme=recipes[cell["recipe"]].quantization,
                            algorithm=cell.get("quant_algorithm"), export_only=bool(cell.get("export_only")),
                            params=int(cell["params"]), seconds=dict(cell["stages_s"]), speed=speed,
                            cpu=cell.get("cpu") or "?", cores=cell.get("cores"), date=cell.get("date") or ""))
    return tuple(found)


def speed_of(stage: str, speed: HostSpeed) -> float:
    return speed.python_mops if stage in PYTHON_STAGES else speed.matmul_gflops


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


# A stage measured at one model size only scales with the parameters at this exponent (a pass over the weights).
ONE_SIZE_EXPONENT = 1.0
MIN_SECONDS = 0.01  # a stage measured as less counts as this, so its logarithm is finite


def _fit(cells: list[Sample], stage: str, group: tuple, widest: bool) -> Fit | None:
    """The stage's fit on these cells (seconds made unit-speed ones); None when they measured fewer than two
    model sizes, unless this is the widest group, which scales its one size at ONE_SIZE_EXPONENT."""
    measured = [c for c in cells if stage in c.seconds]
    points = [(c.params, max(MIN_SECONDS, c.seconds[stage]) * speed_of(stage, c.speed)) for c in measured]
    sizes = {c.params for c in measured}
    if len(sizes) >= 2:
        scale, exponent = fit_power_law(points)
    elif sizes and widest:
        exponent = ONE_SIZE_EXPONENT
        scale = math.exp(sum(math.log(s) - exponent * math.log(p / 1e9) for p, s in points) / len(points))
    else:
        return None
    return Fit(scale, exponent, len(measured), min(sizes), max(sizes), group)


@functools.lru_cache(maxsize=512)
def stage_fit(stage: str, backend: str, scheme: str, algorithm: str | None, export_only: bool,
              path: str, _mtime_ns: int) -> Fit | None:
    return fit_stage(_samples(path, _mtime_ns), stage, backend, scheme, algorithm, export_only)


def fit_stage(cells: tuple[Sample, ...], stage: str, backend: str, scheme: str, algorithm: str | None,
              export_only: bool) -> Fit | None:
    """The stage's fit for a recipe like this, from the narrowest group of cells that measured two sizes. Where a
    narrower group measured one size only, the fit keeps that group's own level there and takes only its slope
    from the wider group: a recipe's fixed costs (graph passes per layer) differ more between recipes than their
    growth with the model does."""
    wanted = {"backend": backend, "scheme": scheme, "algorithm": algorithm, "export_only": export_only}
    groupings = GROUPINGS[stage]
    anchor: list[Sample] = []  # the narrowest group's cells, when they measured one size
    for index, grouping in enumerate(groupings):
        chosen = [c for c in cells if all(getattr(c, key) == wanted[key] for key in grouping)]
        fit = _fit(chosen, stage, tuple(wanted[key] for key in grouping), widest=index == len(groupings) - 1)
        if fit is not None:
            return _anchored(fit, anchor, stage) if anchor else fit
        if not anchor:
            anchor = [c for c in chosen if stage in c.seconds]
    return None


def _anchored(fit: Fit, cells: list[Sample], stage: str) -> Fit:
    """`fit`'s slope through the level `cells` (all of one model size) measured."""
    logs = [math.log(max(MIN_SECONDS, c.seconds[stage]) * speed_of(stage, c.speed))
            - fit.exponent * math.log(c.params / 1e9) for c in cells]
    return Fit(math.exp(sum(logs) / len(logs)), fit.exponent, fit.cells + len(cells),
               min(fit.smallest, cells[0].params), max(fit.largest, cells[0].params), fit.group)


def estimate_time(params: int, recipes: list, options: dict, generate: bool, speed: HostSpeed,
                  path: Path = ZOO_RESULTS, cells: list[dict] | None = None) -> tuple[list[TimeEstimate], list[str]]:
    """Each recipe's seconds (as its report's timings_s.estimate, in the order of `recipes`) of running `recipes`
    (registry Recipes, one after another) on a model of `params` parameters, on a host of `speed`; and notes on
    where the estimate leaves what the cells measured. options: recipe name -> its options (the algorithm among
    them). The rates come from the results.json at `path`, or from `cells` (its cells' JSON objects, e.g. some of
    them) when given."""
    key = _version(Path(path)) if cells is None else None  # a file's fits are cached, by its version
    samples = _samples(*key) if key else samples_of(cells)
    if not samples:
        raise ValueError(f"{path if cells is None else 'the cells given'} has no cell measured alone with its stages; "
                         "the time estimate needs some.")
    used: list[Fit] = []
    notes: list[str] = []

    def seconds(stage: str, recipe=None) -> float | None:
        backend = recipe.backend.name if recipe else ""
        scheme = recipe.quantization if recipe else ""
        algorithm = options.get(recipe.name, {}).get("quant_algorithm") if recipe else None
        wanted = (stage, backend, scheme, algorithm, not generate)
        fit = stage_fit(*wanted, *key) if key else fit_stage(samples, *wanted)
        if fit is None:
            return None
        used.append(fit)
        if recipe is not None and stage in ("lower", "quantize") and len(fit.group) < len(GROUPINGS[stage][0]):
            what = f"{scheme} with {algorithm}" if stage == "quantize" and algorithm else f"{scheme} on {backend}"
            notes.append(f"no zoo cell measured {what}: its {stage} time is that of similar recipes")
        return fit.seconds(params, speed_of(stage, speed))

    wanted_shared = [s for s in SHARED_STAGES if generate or s not in FULL_JOB_ONLY]
    shared = {stage: s for stage in wanted_shared if (s := seconds(stage)) is not None}
    per_recipe = []  # stage -> seconds on this host, of each recipe's own stages
    for recipe in recipes:
        stages = [s for s in RECIPE_STAGES if generate or s not in FULL_JOB_ONLY]
        per_recipe.append({stage: s for stage in stages if (s := seconds(stage, recipe)) is not None})
        if options.get(recipe.name, {}).get("mixed_precision_budget"):
            notes.append("no zoo cell measured a mixed-precision search, which adds minutes to quantizing")
    smallest, largest = min(f.smallest for f in used), max(f.largest for f in used)
    if not smallest <= params <= largest:
        notes.append(f"a {size_label(params)} model is outside the {size_label(smallest)}–{size_label(largest)} "
                     "the cells measured: extrapolated")
    hosts = sorted({(c.cpu, c.cores) for c in samples})
    dates = sorted(c.date for c in samples if c.date)
    rates_from = "; ".join(f"{cpu}, {cores} cores" for cpu, cores in hosts) + (f" ({dates[0]} to {dates[-1]})"
                                                                               if dates else "")
    reference = sorted(c.speed.python_mops for c in samples)[len(samples) // 2]
    shared_s = sum(shared.values())
    times = [TimeEstimate(export=_part(own, "export"), lower=_part(own, "lower"), other=_part(own, "other"),
                          total=shared_s + sum(own.values()), fitted_on=f"{size_label(smallest)}–{size_label(largest)}",
                          shared=shared_s, rates_from=rates_from, host_speed=speed.python_mops / reference)
             for own in per_recipe]
    return times, list(dict.fromkeys(notes))
