"""`python -m zoo matrix`: zoo models x recipes, each cell one Ray task running `recipes.pipeline.run.run()`
with the cores and memory the job's estimate asks for. Cells are resumable (a result with the same key
is skipped), a failing cell records its stage and reason, and results.json holds every cell."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

from models.errors import UserFacingError
from recipes.process import thread_policy
from recipes.output.report import JobSummary, package_versions
from recipes.output.summary import recipe_figures
from recipes.estimates.time_estimate import RECIPE_STAGES, SHARED_STAGES
from zoo.cell_result import CellResult, JobFigures, TaskHost, ZooResults, load_cell, load_results
from zoo.entries import NEEDS_REAL_WEIGHTS, ZooEntry, find_entry, repo_slug

PROJECT_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS_RANDOM = "random bf16, shape-identical"
WEIGHTS_BUILTIN = "built-in GGUF (real weights, Q4_1)"


@dataclass(frozen=True)
class Cell:
    entry: ZooEntry
    recipe: str
    options: dict
    max_seq_len: int
    generate: bool
    weights: str  # WEIGHTS_RANDOM, WEIGHTS_BUILTIN or "hub"
    identity: str  # Hub revision, config hash or built-in file: what makes two results comparable
    versions: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        fields = {"model": self.entry.repo_id, "identity": self.identity, "recipe": self.recipe,
                  "options": self.options, "max_seq_len": self.max_seq_len, "generate": self.generate,
                  "versions": self.versions}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def parse_recipe(spec: str) -> tuple[str, dict]:
    """`xnnpack-8da4w` or `xnnpack-8da4w:group_size=128,soc=SM8650`."""
    name, _, rest = spec.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise UserFacingError(f"recipe option {pair!r} in {spec!r} is not key=value; write e.g. {name}:group_size=64.")
        options[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return name, options


def config_hash(config: dict) -> str:
    return "config-sha256:" + hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def weights_for(entry: ZooEntry, weights: str) -> tuple[str, str]:
    """(weights source, identity). `auto`: the built-in GGUF for the built-in model, the Hub when it answers,
    else a shape-identical random checkpoint."""
    if entry.builtin and weights in ("auto", "builtin"):
        from models.sources.checkpoint import builtin_gguf_path  # loads torch, which a Ray task loads after its thread policy

        gguf = builtin_gguf_path()
        if gguf is not None:
            return WEIGHTS_BUILTIN, f"builtin:{gguf.name}:{gguf.stat().st_size}"
    if weights in ("auto", "hub"):
        revision = hub_revision(entry.repo_id)
        if revision:
            return "hub", f"hub:{revision}"
        if weights == "hub":
            raise UserFacingError(f"the Hub does not answer for {entry.repo_id}; use --weights random or auto.")
    return WEIGHTS_RANDOM, config_hash(entry.config)


def hub_revision(repo_id: str) -> str | None:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return None
    try:
        from huggingface_hub import HfApi

        return HfApi().model_info(repo_id, timeout=5, token=os.environ.get("HF_TOKEN")).sha
    except Exception:  # offline, gated without a token, or not found: all mean "no real weights here"
        return None


def plan_cells(entries: list[ZooEntry], recipe_specs: list[str], max_seq_len: int, generate: bool,
               weights: str = "auto") -> list[Cell]:
    """One cell per model x recipe. `recommended` stands for each model's recommended recipes, with their
    options; a zoo recommendation's options also apply when its recipe is named plainly."""
    from recipes.registry import backend_packages  # loads torch, which a Ray task loads after its thread policy

    found_versions = package_versions(backend_packages())
    cells = []
    for entry in entries:
        source, identity = weights_for(entry, weights)
        specs = []
        for spec in recipe_specs:
            if spec == "recommended":
                specs += [(r["recipe"], dict(r.get("options", {}))) for r in entry.recommended.values()]
            else:
                name, options = parse_recipe(spec)
                recommended = {r["recipe"]: r.get("options", {}) for r in entry.recommended.values()}
                specs.append((name, {**recommended.get(name, {}), **options}))
        limit = int(entry.config.get("max_position_embeddings") or max_seq_len)
        for name, options in dict(((n, json.dumps(o, sort_keys=True)), (n, o)) for n, o in specs).values():
            cells.append(Cell(entry, name, options, min(max_seq_len, limit), generate, source, identity,
                              found_versions))
    return cells


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def base_record(cell: Cell) -> CellResult:
    """What every cell's record holds: the question it answers, and where and when it was asked."""
    # these load torch, which a Ray task loads after its thread policy
    from recipes.estimates.memory_estimate import parameter_count
    from recipes.registry import get_recipe

    now = time.gmtime()
    return CellResult(
        key=cell.key, model=cell.entry.repo_id, recipe=cell.recipe, backend=get_recipe(cell.recipe).backend.name,
        params=parameter_count(cell.entry.model_config()),
        options=cell.options, max_seq_len=cell.max_seq_len, export_only=not cell.generate,
        weights=cell.weights, model_identity=cell.identity, versions=cell.versions,
        date=time.strftime("%Y-%m-%d", now), measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", now),
        cpu=cpu_name(), cores=os.cpu_count(),
    )


def record_from_report(record: CellResult, summary: JobSummary, random_weights: bool) -> CellResult:
    """The zoo's record of a cell from its one-recipe job."""
    report = summary.recipes[0]
    figures = recipe_figures(report, summary.reference)
    error = report.errors[0] if report.errors else None
    fidelity = report.fidelity
    ratio = None
    if fidelity and fidelity.perplexity and fidelity.perplexity_fp32:
        ratio = round(fidelity.perplexity / fidelity.perplexity_fp32, 4)
    measured = JobFigures(
        delegated_percent=figures.delegated_percent, pte_mb=figures.pte_mb, ptd_mb=figures.ptd_mb,
        export_s=report.timings.export, lower_s=report.timings.lower, peak_rss_mb=report.timings.peak_rss_mb,
        decode_tokens_per_s=figures.decode_tokens_per_s, engine=figures.engine,
        perplexity_ratio=None if random_weights else ratio,
        fidelity=NEEDS_REAL_WEIGHTS if random_weights else ("measured" if ratio is not None else "not measured"),
        runtime_note=report.runtime_note,
        # each stage's seconds, measured with the whole node (cell_cpus): the time estimate's rates
        stages_s={stage: seconds for stage in (*SHARED_STAGES, *RECIPE_STAGES)
                  if isinstance(seconds := getattr(report.timings, stage), (int, float))},
        alone=True,
        # the int4 algorithm the job ran, the scheme's default included (None: the scheme takes none)
        quant_algorithm=report.recipe.options.get("quant_algorithm"),
    )
    return replace(record, status="failed" if error else "ok", stage=error.stage if error else None,
                   reason=error.message if error else None, figures=measured)


def run_cell(cell: Cell, model_path: str | None, run_dir: str, keep_pte: bool, tracker=None,
             memory_limit_bytes: int | None = None) -> CellResult:
    """The body of one Ray task: the same `run()` as `python -m recipes run`, one recipe, one model. With
    memory_limit_bytes (what the node offers a task), the job plans its memory (its reference's form, say)
    for that limit, as the matrix's estimate did, not for the node's free RAM."""
    thread_policy.limit_openmp_default()
    if memory_limit_bytes is not None:
        from recipes.estimates.memory_estimate import GB, LIMIT_ENV  # loads torch, after the thread policy

        os.environ[LIMIT_ENV] = f"{memory_limit_bytes / GB:.3f}"
    if tracker is not None:
        tracker.started.remote(cell.key)
    # torch loads here, after the thread policy
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    from recipes.estimates.host_speed import host_speed  # loads torch, after the thread policy

    record = replace(base_record(cell), task=TaskHost(host=platform.node(),  # on a cluster: the node that ran the cell
                                                      memory_limit_bytes=memory_limit_bytes, host_speed=host_speed()))
    started = time.perf_counter()
    request = RunRequest(recipes=[cell.recipe], out_dir=Path(run_dir), model=model_path, options=cell.options,
                         max_seq_len=cell.max_seq_len, max_new_tokens=min(32, cell.max_seq_len // 4),
                         generate=cell.generate, token=os.environ.get("HF_TOKEN"))
    try:
        summary = run(request)
    except UserFacingError as err:  # refused before any export (options, context, checkpoint)
        return replace(record, status="failed", stage="request", reason=str(err),
                       seconds=round(time.perf_counter() - started, 1))
    except Exception as err:  # an unexpected failure of this cell must not stop the matrix
        return replace(record, status="failed", stage="run", reason=f"{type(err).__name__}: {err}",
                       seconds=round(time.perf_counter() - started, 1))
    result = record_from_report(record, summary, random_weights=cell.weights == WEIGHTS_RANDOM)
    if not keep_pte:  # the program and its weights file: a big model's cells would fill the disk
        for name in ("model.pte", "model.ptd"):
            (Path(run_dir) / name).unlink(missing_ok=True)
    return replace(result, seconds=round(time.perf_counter() - started, 1))


def build_checkpoint(config: dict, folder: str) -> str:
    from models.sources.random_checkpoint import write_random_checkpoint  # loads torch, in the Ray task only

    return str(write_random_checkpoint(config, Path(folder)))


def runtime_env() -> dict:
    """Workers of a local cluster import the project from this folder; a remote cluster gets it uploaded."""
    return {"env_vars": {"PYTHONPATH": str(PROJECT_ROOT)}}


def connect(address: str | None, memory_gb: float | None) -> None:
    """Ray local by default, with this machine's cores (and at most `memory_gb` for tasks), or a cluster."""
    import ray

    if ray.is_initialized():
        return
    if address:
        try:
            ray.init(address=address, runtime_env={"working_dir": str(PROJECT_ROOT),
                                                   "excludes": [".git", "out", "jobs", "bench/.cache"]})
        except ConnectionError as err:
            raise UserFacingError(connection_advice(address, err)) from err
        return
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=runtime_env(),
             **({"_memory": int(memory_gb * 1024**3)} if memory_gb else {}))


def connection_advice(address: str, err: Exception) -> str:
    """What to do when the cluster does not take the connection. `ray start --head` turns on Ray's token
    authentication, which a driver only uses with RAY_AUTH_MODE=token set."""
    chain = "".join(traceback.format_exception(err))
    if "InvalidAuthToken" in chain or "AuthenticationError" in chain:
        return (f"the Ray cluster at {address} asks for its token: set RAY_AUTH_MODE=token, with the token in "
                "RAY_AUTH_TOKEN or ~/.ray/auth_token (`ray get-auth-token` on the head prints it), and run again.")
    return (f"could not connect to the Ray cluster at {address} ({str(err).splitlines()[0]}); check the address "
            f"with `ray status --address {address}`, or leave out --ray-address for a local cluster.")


def largest_node() -> tuple[float, float]:
    """(cores, memory bytes) of the largest alive node: what one cell can be given."""
    import ray

    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return max(n.get("CPU", 0) for n in nodes), max(n.get("memory", 0) for n in nodes)


def cell_cpus(node_cpus: float) -> int:
    """Every cell takes a whole node: a cell beside it would share its cores, and its stages' seconds are what the
    time estimate is fitted on (recipes/estimates/time_estimate.py), as a decode's tok/s is what the zoo shows."""
    return max(1, int(node_cpus))


def refusal(cell: Cell, estimate, node_memory: float) -> CellResult | None:
    if estimate.peak_rss_bytes <= node_memory:
        return None
    gib = 1024**3  # Ray counts memory in bytes; --memory-gb gives GiB, as Ray's own CLI does
    return replace(base_record(cell), status="refused", stage="memory-estimate",
                   reason=(f"needs ~{estimate.peak_rss_bytes / gib:.1f} GiB (the estimated peak, at "
                           f"{estimate.peak_stage}); the largest node offers {node_memory / gib:.1f} GiB to a task: "
                           "run it on a node with more memory (--ray-address)"),
                   estimate_gib=round(estimate.peak_rss_bytes / gib, 2))


def oom_record(cell: Cell, err: Exception) -> CellResult:
    return replace(base_record(cell), status="oom", stage="run",
                   reason=f"out of memory: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500])


def _tracker_class():
    import ray

    @ray.remote(num_cpus=0)
    class CellTracker:
        """Which cells a worker has started: the difference between running and queued."""

        def __init__(self):
            self.keys = set()

        def started(self, key: str) -> None:
            self.keys.add(key)

        def count(self) -> int:
            return len(self.keys)

    return CellTracker


def cell_file(out: Path, slug: str, recipe: str, key: str) -> Path:
    """Where a cell's record is kept: named by its model's zoo slug, its recipe and its key."""
    return Path(out) / "cells" / f"{slug}--{recipe}--{key}.json"


def cell_path(out: Path, cell: Cell) -> Path:
    return cell_file(out, cell.entry.slug, cell.recipe, cell.key)


def done_before(out: Path, cell: Cell) -> bool:
    """A result exists and is not an OOM kill (which depends on what else ran on the node: tried again)."""
    path = cell_path(out, cell)
    return path.is_file() and load_cell(path).status != "oom"


def run_matrix(cells: list[Cell], out: Path, keep_pte: bool = False, log=print, remeasure: bool = False) -> dict:
    """Runs the cells not already in `out` (OOM kills are tried again; with remeasure, every cell) on the connected
    Ray cluster; writes each cell's result as it lands and results.json at the end. Returns {"computed": n,
    "skipped": m, "cells": [every record]}."""
    import ray
    from tqdm import tqdm

    # these load torch, which a Ray task loads after its thread policy
    from recipes.files.atomic_write import write_atomically
    from recipes.estimates.memory_estimate import estimate_job
    from recipes.registry import get_recipe

    out = Path(out)
    todo = [c for c in cells if remeasure or not done_before(out, c)]
    skipped = len(cells) - len(todo)
    node_cpus, node_memory = largest_node()
    remote_cell = ray.remote(max_retries=0, max_calls=1)(run_cell)
    remote_build = ray.remote(max_retries=0, max_calls=1)(build_checkpoint)
    tracker = _tracker_class().remote()
    built: dict[str, object] = {}
    pending: dict[object, Cell] = {}
    finished = 0
    for cell in todo:
        estimate = estimate_job(cell.entry.model_config(), [get_recipe(cell.recipe)], cell.max_seq_len, cell.generate,
                                budget_bytes=node_memory, options={cell.recipe: cell.options})
        refused = refusal(cell, estimate, node_memory)
        if refused is not None:
            write_atomically(cell_path(out, cell), refused.to_json().encode())
            log(f"refused {cell.entry.repo_id} x {cell.recipe}: {refused.reason}")
            finished += 1
            continue
        model_path = None if cell.weights == WEIGHTS_BUILTIN else (cell.entry.repo_id if cell.weights == "hub" else None)
        if cell.weights == WEIGHTS_RANDOM:
            if cell.identity not in built:
                folder = out / "checkpoints" / f"{cell.entry.slug}-{cell.identity.split(':')[-1]}"
                built[cell.identity] = remote_build.options(num_cpus=1, memory=min(estimate.peak_rss_bytes,
                                                                                  node_memory)).remote(
                    cell.entry.config, str(folder))
            model_path = built[cell.identity]  # Ray hands the task the folder once the build finished
        run_dir = out / "runs" / cell.entry.slug / f"{cell.recipe}-{cell.key}"
        ref = remote_cell.options(num_cpus=cell_cpus(node_cpus), memory=estimate.peak_rss_bytes).remote(
            cell, model_path, str(run_dir), keep_pte, tracker, node_memory)
        pending[ref] = cell
    computed = 0
    with tqdm(total=len(cells), initial=skipped + finished, desc="cells", unit="cell") as bar:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=10)
            started = ray.get(tracker.count.remote())
            bar.set_postfix(running=max(0, started - computed), queued=max(0, len(pending) - (started - computed)))
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except (ray.exceptions.OutOfMemoryError, ray.exceptions.WorkerCrashedError) as err:
                    record = oom_record(cell, err)
                except ray.exceptions.RayTaskError as err:  # the checkpoint build failed: the cell cannot run
                    record = replace(base_record(cell), status="failed", stage="random-checkpoint",
                                     reason=str(err).splitlines()[-1][:500])
                write_atomically(cell_path(out, cell), record.to_json().encode())
                computed += 1
                bar.update(1)
                log(f"{record.status:<7} {cell.entry.repo_id} x {cell.recipe}"
                    + (f" ({record.stage}: {record.reason[:160]})" if record.reason else ""))
    records = write_results(out)
    return {"computed": computed + finished, "skipped": skipped, "cells": records}


def _question(record: CellResult) -> str:
    """What a cell answers: a later cell asking the same (with newer versions, say) supersedes it."""
    return json.dumps([record.model, record.recipe, record.options, record.max_seq_len, record.export_only,
                       record.weights], sort_keys=True)


def latest_cells(records: list[CellResult]) -> list[CellResult]:
    """One record per question, the latest measured (a tie: an answer over a refusal or a failure)."""
    latest: dict[str, CellResult] = {}
    for record in sorted(records, key=lambda r: (r.measured_at or r.date, r.status == "ok")):
        latest[_question(record)] = record
    return list(latest.values())


def _model_slug(repo_id: str) -> str:
    """The zoo entry's slug (what cell_file names a cell's file by); for a model the zoo no longer lists, the one an
    entry file of that repo would get."""
    try:
        return find_entry(repo_id).slug
    except UserFacingError:
        return repo_slug(repo_id)


def seed_cells(out: Path, results_path: Path) -> int:
    """out/cells filled from an earlier results.json (a cell already in out is kept), so a matrix run adds to
    the zoo instead of replacing it; returns how many were written."""
    from recipes.files.atomic_write import write_atomically  # loads torch, which a Ray task loads after its thread policy

    written = 0
    for record in load_results(results_path).cells:
        path = cell_file(out, _model_slug(record.model), record.recipe, record.key)
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, record.to_json().encode())
            written += 1
    return written


def write_results(out: Path) -> list[CellResult]:
    """results.json (the latest cell of each question in out/cells), README.md and heatmap.png beside it."""
    # these load torch, which a Ray task loads after its thread policy
    from recipes.files.atomic_write import write_atomically
    from zoo.report import write_readme

    records = sorted(latest_cells([load_cell(p) for p in (Path(out) / "cells").glob("*.json")]),
                     key=lambda r: (r.backend, r.model, r.recipe))
    document = ZooResults(generated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), cpu=cpu_name(),
                          cores=os.cpu_count(), cells=records)
    write_atomically(Path(out) / "results.json", document.to_json().encode())
    write_readme(document, Path(out))
    return records


def run_from_args(args) -> int:
    entries = [find_entry(name) for name in args.models]
    cells = plan_cells(entries, args.recipes, args.max_seq_len, generate=not args.export_only, weights=args.weights)
    from recipes.registry import get_recipe  # loads torch, which a Ray task loads after its thread policy

    for cell in cells:
        get_recipe(cell.recipe)  # an unknown recipe name stops the matrix before any cell starts
    if args.seed_from is not None:
        print(json.dumps({"seeded": seed_cells(args.out, args.seed_from), "from": str(args.seed_from)}))
    connect(args.ray_address, args.memory_gb)
    result = run_matrix(cells, args.out, keep_pte=args.keep_pte, log=lambda msg: print(msg, flush=True),
                        remeasure=args.remeasure)
    print(json.dumps({"computed": result["computed"], "skipped": result["skipped"],
                      "results": str(Path(args.out) / "results.json")}))
    return 0


def add_parser(sub) -> None:
    matrix = sub.add_parser("matrix", help="zoo models x recipes on Ray (resumable)")
    matrix.add_argument("--models", nargs="+", required=True, help="zoo repo ids, entry names or entry .json files")
    matrix.add_argument("--recipes", nargs="+", required=True,
                        help="recipe names, `name:key=value,...` for options, or `recommended`")
    matrix.add_argument("--out", required=True, type=Path, help="results folder (cells/, runs/, results.json)")
    matrix.add_argument("--seed-from", type=Path, metavar="RESULTS_JSON",
                        help="start --out's cells from this results.json (e.g. zoo/results.json): the run adds to "
                             "it, a re-measured cell replacing its earlier answer")
    matrix.add_argument("--ray-address", default=None, help="a running Ray cluster (default: a local one)")
    matrix.add_argument("--export-only", action="store_true", help="no generation and no fidelity: .pte figures only")
    matrix.add_argument("--max-seq-len", type=int, default=512, help="max context (capped at each model's limit)")
    matrix.add_argument("--weights", choices=("auto", "hub", "random"), default="auto",
                        help="auto: built-in GGUF for the built-in model, the Hub when it answers, else random")
    matrix.add_argument("--memory-gb", type=float, default=None, help="memory (GiB) the local cluster gives its tasks")
    matrix.add_argument("--remeasure", action="store_true",
                        help="run every cell, even one measured before with the same key (the new result replaces it)")
    matrix.add_argument("--keep-pte", action="store_true", help="keep each cell's model.pte (default: measured, dropped)")
