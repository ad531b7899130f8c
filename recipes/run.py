"""Run one or several recipes on one checkpoint: load once, quantize and export once per distinct
(scheme, module options), lower per recipe, generate, and write model.pte + report.json per recipe.
This is the function both `python -m recipes run` and the app call."""
from __future__ import annotations

import gc
import json
import platform
import resource
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from recipes import malloc_policy
from recipes import thread_policy
from models.errors import UserFacingError
from models.checkpoint import Checkpoint, load_checkpoint
from models.llama import ExportOptions, build_exportable
from quant.layer_error import eager_layer_outputs
from quant.schemes import SCHEMES
from recipes import fidelity
from recipes import generate as gen
from recipes import llm_runner, memory_estimate, rss
from recipes import profile as profiling
from recipes.layer_map import layer_map, windows_of
from recipes.llm_metadata import llm_metadata
from recipes.lowering import OutputWriteError, export_program, lower_for_backend, write_atomically
from recipes.registry import Recipe, get_recipe

Progress = Callable[[float, str], None]
# The eager reference runs in fp32 when it fits, else in the checkpoint's own dtype (memory_estimate.py).
REFERENCE_ENGINES = {torch.float32: gen.ENGINE_EAGER_FP32, torch.bfloat16: "eager-bf16", torch.float16: "eager-fp16"}


class Cancelled(UserFacingError):
    pass


@dataclass
class RunRequest:
    recipes: list[str]
    out_dir: Path
    model: str | None = None
    revision: str | None = None
    token: str | None = field(default=None, repr=False)
    allow_pickle: bool = False
    prompt: str = gen.DEFAULT_PROMPT
    max_new_tokens: int = 32
    max_seq_len: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    options: dict = field(default_factory=dict)  # recipe options: group_size, ...
    # False: only the .pte and its delegation report (CI jobs that test the .pte elsewhere); no sample
    # generations and no fidelity, so the report's generations list is empty.
    generate: bool = True
    # An event-traced second pass of the generation, after the timed one (recipes/profile.py).
    profile: bool = True
    # ExecuTorch's ETRecord beside model.pte (its devtools map a profile back to the graph); it holds the
    # exported and edge programs with their weights, a few times the .pte, so it is asked for.
    etrecord: bool = False
    # fidelity.layers: each decoder layer's error against fp32; where the .pte runs here it costs a second
    # export and lowering (with the layer outputs tapped), so it is asked for.
    layer_map: bool = False


def user_options(group_size=None, quant_algorithm=None, mixed_precision_budget=None) -> dict:
    """The recipe options a user set, from the CLI's flags or the app's Advanced controls. Unset ones (None, 0,
    "") are left out, so each recipe keeps its own defaults."""
    given = {"group_size": int(group_size) if group_size else None, "quant_algorithm": quant_algorithm or None,
             "mixed_precision_budget": None if mixed_precision_budget is None else float(mixed_precision_budget)}
    return {key: value for key, value in given.items() if value is not None}


def recipe_option_pairs(pairs: list[str]) -> dict:
    """`KEY=VALUE` strings (the CLI's --option) as recipe options; whole numbers become ints."""
    options = {}
    for pair in pairs:
        key, eq, value = (part.strip() for part in pair.partition("="))
        if not eq or not key or not value:
            raise UserFacingError(f"recipe option {pair!r} is not KEY=VALUE; write e.g. --option layers_per_shard=2.")
        options[key] = int(value) if value.isdigit() else value
    return options


def versions() -> dict:
    import importlib.metadata as md

    from recipes.registry import load_backends

    found = {}
    packages = [b for backend in load_backends().backends.values() for b in backend.packages]
    for name in dict.fromkeys(("torch", "executorch", "torchao", "transformers", *packages)):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


def peak_rss_mb(stage_peaks: dict) -> float:
    """The job's peak: its stages' (Linux resets the high-water mark for each, which ru_maxrss then misses)
    or the lifetime peak, whichever is higher."""
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return round(max([lifetime, *(v for v in stage_peaks.values() if v is not None)]), 1)


STAGE_PEAKS = "peak_rss_mb_by_stage"  # in timings while the job runs; the report's memory section after


def validate_request(request: RunRequest, recipes: list[Recipe]) -> None:
    if not request.recipes:
        raise UserFacingError("no recipe chosen; pick at least one (see `python -m recipes list`).")
    if len(set(request.recipes)) != len(request.recipes):
        raise UserFacingError("a recipe is named twice; name each recipe once.")
    if request.max_seq_len < 16:
        raise UserFacingError(f"max context must be at least 16 tokens, got {request.max_seq_len}.")
    if request.max_new_tokens < 1:
        raise UserFacingError(f"max new tokens must be at least 1, got {request.max_new_tokens}.")
    if request.max_new_tokens >= request.max_seq_len:
        raise UserFacingError(
            f"max new tokens ({request.max_new_tokens}) must be smaller than max context ({request.max_seq_len})."
        )
    if not request.prompt.strip():
        raise UserFacingError("the prompt is empty; type a prompt.")
    from quant.quantize import check_options
    from quant.schemes import check_group_size

    # The app sends every backend's options with every job; each recipe takes those it has. A name no recipe
    # takes is a mistake (a typo would otherwise be dropped silently).
    from recipes.registry import load_backends

    known = {key for recipe in load_backends().recipes.values() for key in recipe_defaults(recipe)}
    unknown = sorted(set(request.options) - known - {"group_size", "quant_algorithm", "mixed_precision_budget"})
    if unknown:
        raise UserFacingError(f"{', '.join(unknown)}: no recipe takes this option; the recipes' options: "
                              f"{', '.join(sorted(known))} (`python -m recipes list` shows which recipe takes which).")
    for recipe in recipes:
        options = recipe_options(recipe, request)
        check_group_size(recipe.quantization, options.get("group_size"))
        check_options(recipe.quantization, options)
        recipe.backend.check_options(options)


class _Stages:
    """Progress reporting and cancellation between stages; each stage's seconds land in timings."""

    def __init__(self, progress: Progress | None, cancel: threading.Event | None, total: int):
        self.progress, self.cancel, self.total, self.done = progress, cancel, total, 0

    def begin(self, message: str) -> float:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the job was cancelled; nothing was written for unfinished recipes.")
        if self.progress:
            self.progress(min(self.done / self.total, 0.99), message)
        malloc_policy.trim_freed_heap()
        rss.mark()
        return time.perf_counter()

    def end(self, started: float, timings: dict, key: str) -> None:
        timings[key] = round(timings.get(key, 0.0) + time.perf_counter() - started, 3)
        record_peak(timings, key, rss.peak_bytes() / rss.MB)
        self.done += 1


def record_peak(timings: dict, key: str, peak_mb: float | None) -> None:
    if peak_mb is not None:
        peaks = timings.setdefault(STAGE_PEAKS, {})
        peaks[key] = max(peaks.get(key, 0.0), round(peak_mb, 1))


def check_context(checkpoint: Checkpoint, request: RunRequest) -> None:
    """Refuses, before any export, a context the model cannot hold or, when the job generates, a prompt that
    does not fit in it (an export-only job has no prompt to fit)."""
    from models.prompting import prompt_token_ids

    limit = int(getattr(checkpoint.config, "max_position_embeddings", 0) or 0)
    if limit and request.max_seq_len > limit:
        raise UserFacingError(
            f"max context {request.max_seq_len} is beyond this model's limit of {limit} tokens; choose at most {limit}."
        )
    if not request.generate:
        return
    prompt_tokens = len(prompt_token_ids(checkpoint.tokenizer, request.prompt))
    if prompt_tokens + request.max_new_tokens > request.max_seq_len:
        raise UserFacingError(
            f"the prompt is {prompt_tokens} tokens; with {request.max_new_tokens} new tokens it does not fit in the "
            f"max context of {request.max_seq_len}; shorten the prompt, lower max new tokens or raise max context."
        )


def run(request: RunRequest, progress: Progress | None = None, cancel: threading.Event | None = None) -> dict:
    """Returns the summary {model, recipes: [report, ...]}; each report is also on disk."""
    thread_policy.torch_threads()
    malloc_policy.unmap_large_blocks()
    recipes = [get_recipe(name) for name in request.recipes]
    validate_request(request, recipes)
    stages = _Stages(progress, cancel, total=3 + 7 * len(recipes))
    out_dir = Path(request.out_dir)
    shared_timings: dict = {}

    started = stages.begin("loading the checkpoint")
    estimates: list = []  # the job's memory estimate, made from the config before any weight is read

    def check_memory(config, eval_tokens: list[int] | None = None) -> None:
        options = {recipe.name: recipe_options(recipe, request) for recipe in recipes}
        estimates[:] = [memory_estimate.check_job_fits(config, recipes, request.max_seq_len, request.generate,
                                                       options, eval_tokens)]

    checkpoint = load_checkpoint(
        request.model, revision=request.revision, token=request.token, allow_pickle=request.allow_pickle,
        progress=progress, check_config=check_memory,
    )
    stages.end(started, shared_timings, "load")
    check_context(checkpoint, request)
    from recipes.tokenizer_files import tokenizer_files

    shipped_tokenizer = tokenizer_files(checkpoint.tokenizer)
    from quant.schemes import check_group_size_fits

    for recipe in recipes:
        check_group_size_fits(recipe.quantization, recipe_options(recipe, request).get("group_size"), checkpoint.config)

    reference = eval_reference = None
    if request.generate:
        texts = {"eval": fidelity.EVAL_TEXT, "heldout": fidelity.HELDOUT_TEXT}
        eval_ids = {name: fidelity.eval_token_ids(checkpoint.tokenizer, path) for name, path in texts.items()}
        if estimates:  # again with the texts' token counts by this tokenizer, before the reference is built
            check_memory(checkpoint.config, [len(ids) for ids in eval_ids.values()])
        reference_dtype = estimates[0].reference_dtype if estimates else torch.float32
        weight_dtype = estimates[0].reference_weight_dtype if estimates else None
        if weight_dtype != checkpoint.dtype:
            weight_dtype = None  # only weights stored in that dtype stay in it: a cast would round them
        engine = REFERENCE_ENGINES[reference_dtype]
        started = stages.begin(f"generating with the {engine} reference")
        reference_module = build_exportable(
            checkpoint.config, checkpoint.state_dict,
            ExportOptions(request.max_seq_len, attention="sdpa", dtype=reference_dtype, weight_dtype=weight_dtype),
            tie_output=True,
        )
        reference = _generate(gen.eager_step(reference_module), engine, checkpoint, request)
        if weight_dtype not in (None, reference_dtype):
            reference.weights_dtype = str(weight_dtype).replace("torch.", "")
        stages.end(started, shared_timings, "reference_generation")
        started = stages.begin(f"{engine} reference logits on the evaluation texts")
        eval_reference = {"engine": engine}
        for name, ids in eval_ids.items():
            eval_reference[name] = (ids, fidelity.sequence_logits(gen.eager_step(reference_module), ids,
                                                                  request.max_seq_len),
                                    fidelity.targets_of(ids, request.max_seq_len))
        if request.layer_map:
            eval_reference["layers"] = eager_layer_outputs(
                reference_module, windows_of(eval_reference["eval"][0], request.max_seq_len))
        stages.end(started, shared_timings, "reference_fidelity")
        del reference_module
        gc.collect()  # a parametrized module (models/compute_dtype.py) is freed by the cycle collector only

    prepared: dict[tuple, tuple[torch.nn.Module, str]] = {}  # quantized module and the recipe that made it
    reports = []
    for index, recipe in enumerate(recipes):
        recipe_dir = out_dir if len(recipes) == 1 else out_dir / recipe.name
        needed_later = {preparation_key(later, request) for later in recipes[index + 1:]}
        report = _run_recipe(recipe, checkpoint, request, reference, prepared, stages, shared_timings, recipe_dir,
                             eval_reference=eval_reference, shipped_tokenizer=shipped_tokenizer,
                             estimate=estimates[0] if estimates else None, needed_later=needed_later)
        reports.append(report)
    summary = {"model": checkpoint.describe(), "reference": reference.to_dict() if reference else None,
               "recipes": reports}
    if len(recipes) > 1:
        write_atomically(out_dir / "summary.json", json.dumps(summary_rows(summary), indent=2).encode())
    if progress:
        progress(1.0, "done")
    return summary


def _generate(step, engine: str, checkpoint: Checkpoint, request: RunRequest) -> gen.Generation:
    return gen.generate(
        step, engine, checkpoint.tokenizer, request.prompt, request.max_new_tokens, request.max_seq_len,
        temperature=request.temperature, top_p=request.top_p,
        stop_ids=checkpoint.eos_token_ids,
    )


def _prepare(recipe: Recipe, checkpoint: Checkpoint, request: RunRequest, prepared: dict, stages: _Stages, timings: dict):
    """Quantized module (for eager generation) and ExportedProgram (for lowering), shared by every
    recipe that needs the same scheme, options and module shape."""
    from quant.calibration import calibration_inputs
    from quant.quantize import UnitQuantizer, quantize_module, quantizes_by_unit
    from quant.schemes import SCHEMES

    options = recipe_options(recipe, request)
    scheme = SCHEMES[recipe.quantization]
    export_options = recipe.export_options(request.max_seq_len)
    key = preparation_key(recipe, request)
    if scheme.quantize_exported is None and key in prepared:
        # The quantized module is shared; the program is exported again, because lowering leaves
        # unbacked-symbol state in an ExportedProgram that makes a second lowering of it fail.
        module, shared_with, quantization = prepared[key]
        timings["shared_quantization_with"] = shared_with
        started = stages.begin(f"exporting for {recipe.name}")
        program = export_program(module, request.max_seq_len, strict=recipe.backend.strict_export)
        stages.end(started, timings, "export")
        return module, program, quantization
    started = stages.begin(f"quantizing ({recipe.quantization}) for {recipe.name}, reading its weights")
    if quantizes_by_unit(recipe.quantization, options):
        # the quantized units kept between AWQ's searches must not pin the blocks a search frees
        quantizer = UnitQuantizer(recipe.quantization, options, checkpoint.tokenizer, request.max_seq_len,
                                  around_search=malloc_policy.reusing_large_blocks)
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options, transform_unit=quantizer)
        quantization, seconds = quantizer.section(module), quantizer.seconds
    else:
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options)
        with malloc_policy.reusing_large_blocks():  # AWQ's and mixed precision's passes over the calibration text
            quantization, seconds = quantize_module(module, recipe.quantization, options, checkpoint.tokenizer,
                                                    request.max_seq_len)
    stages.end(started, timings, "quantize")
    timings.update(seconds)
    started = stages.begin(f"exporting for {recipe.name}")
    program = export_program(module, request.max_seq_len, strict=recipe.backend.strict_export)
    stages.end(started, timings, "export")
    if scheme.quantize_exported is not None:
        started = stages.begin(f"calibrating and converting ({recipe.quantization}) for {recipe.name}")
        inputs = calibration_inputs(checkpoint.tokenizer, request.max_seq_len)
        program, module = quantize_exported(recipe, program, inputs, options, request.max_seq_len)
        stages.end(started, timings, "quantize")
        timings["calibration"] = {"prompts": len(inputs), "source": "quant/calibration.py built-in prompts"}
    else:
        prepared[key] = (module, recipe.name, quantization)
    return module, program, quantization


def preparation_key(recipe: Recipe, request: RunRequest) -> tuple:
    """What makes two recipes' quantized modules the same. Source transforms depend on the group size only, so
    backends that differ in other options (SoC, compute units) still share one quantization. PT2E quantizers
    depend on every option: their modules are never shared."""
    options = recipe_options(recipe, request)
    return (recipe.quantization, options.get("group_size"), options.get("quant_algorithm"),
            options.get("mixed_precision_budget"), recipe.export_options(request.max_seq_len))


def quantize_exported(recipe: Recipe, program, calibration, options: dict, max_seq_len: int):
    """A PT2E scheme with the recipe's backend's quantizer: (the program to lower, the converted q/dq
    module whose eager run simulates it)."""
    backend = recipe.backend
    if backend.pt2e_quantizer is None:
        raise UserFacingError(f"{backend.name} has no PT2E quantizer for {recipe.quantization}.")
    program, module = SCHEMES[recipe.quantization].quantize_exported(
        program, calibration, lambda graph_module: backend.pt2e_quantizer(recipe.quantization, options, graph_module),
        backend.static_tokens, max_seq_len,
    )
    if backend.pt2e_program_passes is not None:
        program = backend.pt2e_program_passes(program, recipe.quantization)
    return program, module


def recipe_defaults(recipe: Recipe) -> dict:
    from quant.schemes import scheme_options

    return {**scheme_options(recipe.quantization), **recipe.options}


def recipe_options(recipe: Recipe, request: RunRequest) -> dict:
    defaults = recipe_defaults(recipe)
    return {**defaults, **{k: v for k, v in request.options.items() if k in defaults}}


def _run_recipe(recipe, checkpoint, request, reference, prepared, stages, shared_timings, recipe_dir: Path,
                eval_reference: dict | None = None, shipped_tokenizer: dict[str, bytes] | None = None,
                estimate=None, needed_later: set | None = None) -> dict:
    timings = dict(shared_timings)
    timings[STAGE_PEAKS] = dict(shared_timings.get(STAGE_PEAKS, {}))
    report = {
        "model": checkpoint.describe(),
        "recipe": {"name": recipe.name, "backend": recipe.backend.name, "quantization": recipe.quantization,
                   "options": recipe_options(recipe, request), "max_seq_len": request.max_seq_len,
                   "runs_on": recipe.backend.runs_on},
        "versions": versions(),
        "threads": thread_policy.describe(),
        "timings_s": timings,
        "pte": None,
        "llm_metadata": None,
        "delegation": None,
        "generations": [reference.to_dict()] if reference else [],
        "quantization": None,
        "fidelity": None,
        "errors": [],
    }
    module = lowered = None
    stage = "prepare"
    try:
        module, program, report["quantization"] = _prepare(recipe, checkpoint, request, prepared, stages, timings)
        stage = "lower"
        backend = recipe.backend
        started = stages.begin(f"lowering to {backend.title} ({recipe.name})")
        options = report["recipe"]["options"]
        report["recipe"]["options"] = {**options, **backend.describe_options(options)}
        report["llm_metadata"] = llm_metadata(program, request.max_seq_len, checkpoint.config, checkpoint.tokenizer,
                                              _stop_ids(checkpoint))
        key = preparation_key(recipe, request)
        if not request.generate and key not in (needed_later or set()):
            # Nothing runs the module again: the program's weights are its only copy, released once lowered.
            prepared.pop(key, None)
            module = None
        lowered = lower_for_backend(program, recipe, options, constant_methods=report["llm_metadata"],
                                    generate_etrecord=request.etrecord, pte_path=recipe_dir / "model.pte",
                                    consume_program=True)
        stages.end(started, timings, "lower")
        timings["lower"], timings["serialize"] = round(lowered.lower_s, 3), round(lowered.serialize_s, 3)
        timings[STAGE_PEAKS].update(lower=lowered.lower_peak_rss_mb, serialize=lowered.serialize_peak_rss_mb)
        del program  # the lowered program is in the .pte now; what stays is the module, for eager runs
        # The export and lowering graphs are reference cycles: collected now, their memory is reused by the
        # runtime's load of the .pte instead of adding to it.
        gc.collect()
        malloc_policy.trim_freed_heap()
        report["delegation"] = lowered.delegation
    except (Cancelled, OutputWriteError):
        raise
    except Exception as err:  # a failing backend must not take the other recipes down; the report says why
        report["errors"].append(_error(stage, err))
    step = engine = None
    if not request.generate:
        report["generation_note"] = "export only: no sample generations and no fidelity were asked for"
    elif module is not None:
        try:
            started = stages.begin(f"generating with {recipe.name}")
            step, engine = _recipe_engine(recipe, module, lowered, report)
            report["generations"].append(_generate(step, engine, checkpoint, request).to_dict())
            stages.end(started, timings, "generate")
        except Cancelled:
            raise
        except Exception as err:
            report["errors"].append(_error("generate", err))
    if step is not None and eval_reference is not None:
        try:
            started = stages.begin(f"measuring fidelity of {recipe.name}")
            report["fidelity"] = _recipe_fidelity(recipe, step, engine, request, eval_reference)
            stages.end(started, timings, "fidelity")
            report["fidelity"]["layers"] = None
            if request.layer_map:
                started = stages.begin(f"mapping error per layer of {recipe.name}")
                report["fidelity"]["layers"] = layer_map(
                    engine, module, recipe, report["recipe"]["options"], eval_reference["layers"],
                    windows_of(eval_reference["eval"][0], request.max_seq_len), request.max_seq_len,
                    on_runtime=engine == gen.ENGINE_RUNTIME)
                stages.end(started, timings, "layer_map")
        except Cancelled:
            raise
        except Exception as err:  # a measurement that fails does not withhold a good .pte; the report says why
            if report["fidelity"] is None:
                report["fidelity"] = {"error": _error("fidelity", err)}
            else:
                report["fidelity"]["layers"] = {"error": _error("layer_map", err)}
    # The step loop's program and the quantized module (unless a later recipe shares it) are released before
    # the LLM runner and the profile load the .pte again.
    step = module = None
    for key in [key for key in prepared if key not in (needed_later or set())]:
        del prepared[key]
    if lowered is not None and report["errors"]:
        lowered.pte_path.unlink(missing_ok=True)  # a recipe that failed later ships no .pte
    if lowered is not None and not report["errors"]:
        report["pte"] = {"path": str(lowered.pte_path), "bytes": lowered.pte_bytes, "sha256": lowered.pte_sha256}
        for name, data in (shipped_tokenizer or {}).items():
            write_atomically(recipe_dir / name, data)
        if request.generate and recipe.backend.cannot_run_here() is None:
            started = stages.begin(f"generating with ExecuTorch's LLM runner ({recipe.name})")
            _runner_generation(recipe, checkpoint, request, recipe_dir, report)
            stages.end(started, timings, "runner_generate")
        if lowered.etrecord is not None:
            write_atomically(recipe_dir / profiling.ETRECORD_NAME, lowered.etrecord)
    started = stages.begin(f"profiling {recipe.name}")
    report.update(profiling.recipe_profile(report, recipe_dir, recipe.backend.runtime_imports,
                                           lambda step: _generate(step, gen.ENGINE_RUNTIME, checkpoint, request),
                                           enabled=request.profile))
    stages.end(started, timings, "profile")
    timings["peak_rss_mb"] = peak_rss_mb(timings[STAGE_PEAKS])
    report["memory"] = {"peak_rss_mb_by_stage": timings.pop(STAGE_PEAKS), "peak_rss_mb": timings["peak_rss_mb"],
                        "estimate": estimate.to_dict() if estimate is not None else None}
    write_atomically(recipe_dir / "report.json", json.dumps(report, indent=2).encode())
    return report


def _stop_ids(checkpoint: Checkpoint) -> set[int]:
    from models.prompting import stop_token_ids

    return stop_token_ids(checkpoint.tokenizer, checkpoint.eos_token_ids)


def _runner_generation(recipe, checkpoint, request, recipe_dir: Path, report: dict) -> None:
    """The folder's files in ExecuTorch's LLM runner; its generation goes before the step loop's, which stays
    for fidelity and is what the column shows when the runner cannot take the file (the report says why)."""
    try:
        generation = llm_runner.generate_with_runner(
            recipe_dir / "model.pte", recipe_dir / "tokenizer.json", checkpoint.tokenizer, request.prompt,
            request.max_new_tokens, temperature=request.temperature, eos_token_ids=checkpoint.eos_token_ids,
            runtime_imports=recipe.backend.runtime_imports,
        )
    except llm_runner.RunnerFailed as err:
        report["runner_note"] = str(err)
        return
    except Exception as err:  # the runner's failure must not withhold the step loop's generation or the files
        report["runner_note"] = f"ExecuTorch's LLM runner failed: {type(err).__name__}: {err}"
        return
    first_recipe_generation = 1 if report["generations"] and report["generations"][0]["engine"] == gen.ENGINE_EAGER_FP32 else 0
    report["generations"].insert(first_recipe_generation, generation.to_dict())


def _recipe_engine(recipe, module, lowered, report) -> tuple:
    """(step, engine) for a recipe's generation and fidelity: the .pte on the runtime when it runs here
    (loaded once); otherwise the same quantized model in eager PyTorch (or the converted PT2E graph),
    labelled with the recipe's eager engine so it is never mistaken for the backend's output."""
    backend = recipe.backend
    why_not = "lowering failed" if lowered is None else backend.cannot_run_here()
    if why_not is None:
        return gen.runtime_step(gen.load_runtime_method(lowered.pte_path, backend.runtime_imports)), gen.ENGINE_RUNTIME
    report["runtime_note"] = why_not
    return gen.eager_step(module), backend.eager_engine


def _recipe_fidelity(recipe, step, engine, request, eval_reference: dict) -> dict:
    eval_ids, reference_logits, targets = eval_reference["eval"]
    figures = fidelity.compare_step(step, eval_ids, request.max_seq_len, reference_logits, targets)
    report = fidelity.fidelity_report(engine, recipe.quantization, figures, len(targets))
    heldout_ids, heldout_logits, heldout_targets = eval_reference["heldout"]
    report["heldout"] = fidelity.heldout_report(
        fidelity.compare_step(step, heldout_ids, request.max_seq_len, heldout_logits, heldout_targets),
        len(heldout_targets))
    return {**report, "reference_engine": eval_reference["engine"]}


def _error(stage: str, err: Exception) -> dict:
    if isinstance(err, UserFacingError):
        return {"stage": stage, "message": str(err)}
    return {"stage": stage, "message": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)}


def summary_rows(summary: dict) -> list[dict]:
    """One row per recipe: the side-by-side table of the app and summary.json."""
    rows = []
    for report in summary["recipes"]:
        delegation = report.get("delegation") or {}
        runtime = [g for g in report["generations"] if g != summary["reference"]]
        rows.append({
            "recipe": report["recipe"]["name"],
            "backend": report["recipe"]["backend"],
            "delegated_subgraphs": delegation.get("delegated_subgraphs"),
            "delegated_nodes": delegation.get("delegated_nodes"),
            "non_delegated_nodes": delegation.get("non_delegated_nodes"),
            "delegated_percent": delegation.get("delegated_percent"),
            "pte_mb": round(report["pte"]["bytes"] / 1e6, 2) if report.get("pte") else None,
            "export_s": report["timings_s"].get("export"),
            "lower_s": report["timings_s"].get("lower"),
            "decode_tokens_per_s": runtime[0]["decode_tokens_per_s"] if runtime else None,
            "engine": runtime[0]["engine"] if runtime else None,
            "fidelity": report.get("fidelity"),
            **{key: (report.get("fidelity") or {}).get(key)
               for key in ("perplexity", "perplexity_fp32", "top1_agreement_percent", "mean_kl", "meets_target")},
            "error": report["errors"][0]["message"] if report["errors"] else None,
        })
    return rows
