"""Run one or several recipes on one checkpoint: load once, quantize and export once per distinct
(scheme, module options), lower per recipe, generate, and write model.pte + report.json per recipe.
This is the function both `python -m recipes run` and the app call."""
from __future__ import annotations

import hashlib
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

import thread_policy
from errors import UserFacingError
from models.checkpoint import Checkpoint, load_checkpoint
from models.llama import ExportOptions, build_exportable
from quant.schemes import apply_scheme
from recipes import fidelity
from recipes import generate as gen
from recipes import profile as profiling
from recipes.lowering import export_program, lower_to_pte, write_atomically
from recipes.registry import Recipe, get_recipe

Progress = Callable[[float, str], None]


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
    # An event-traced second pass of the generation, after the timed one (recipes/profile.py), and the ETRecord.
    profile: bool = True


def versions() -> dict:
    import importlib.metadata as md

    found = {}
    for name in ("torch", "executorch", "torchao", "transformers", "coremltools"):
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


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
    from quant.compatibility import check_scheme
    from quant.schemes import check_group_size

    for recipe in recipes:
        check_scheme(recipe.backend, recipe.quantization)
        check_group_size(recipe.quantization, recipe_options(recipe, request).get("group_size"))


class _Stages:
    """Progress reporting and cancellation between stages; each stage's seconds land in timings."""

    def __init__(self, progress: Progress | None, cancel: threading.Event | None, total: int):
        self.progress, self.cancel, self.total, self.done = progress, cancel, total, 0

    def begin(self, message: str) -> float:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the job was cancelled; nothing was written for unfinished recipes.")
        if self.progress:
            self.progress(min(self.done / self.total, 0.99), message)
        return time.perf_counter()

    def end(self, started: float, timings: dict, key: str) -> None:
        timings[key] = round(timings.get(key, 0.0) + time.perf_counter() - started, 3)
        self.done += 1


def check_context(checkpoint: Checkpoint, request: RunRequest) -> None:
    """Refuses, before any export, a context the model cannot hold or a prompt that does not fit in it."""
    from models.prompting import prompt_token_ids

    limit = int(getattr(checkpoint.config, "max_position_embeddings", 0) or 0)
    if limit and request.max_seq_len > limit:
        raise UserFacingError(
            f"max context {request.max_seq_len} is beyond this model's limit of {limit} tokens; choose at most {limit}."
        )
    prompt_tokens = len(prompt_token_ids(checkpoint.tokenizer, request.prompt))
    if prompt_tokens + request.max_new_tokens > request.max_seq_len:
        raise UserFacingError(
            f"the prompt is {prompt_tokens} tokens; with {request.max_new_tokens} new tokens it does not fit in the "
            f"max context of {request.max_seq_len}; shorten the prompt, lower max new tokens or raise max context."
        )


def run(request: RunRequest, progress: Progress | None = None, cancel: threading.Event | None = None) -> dict:
    """Returns the summary {model, recipes: [report, ...]}; each report is also on disk."""
    from quant.compatibility import check_recipe_name
    from recipes.registry import RECIPES, load_backends

    thread_policy.torch_threads()
    load_backends()
    for name in request.recipes:
        check_recipe_name(name, RECIPES)
    recipes = [get_recipe(name) for name in request.recipes]
    validate_request(request, recipes)
    for recipe in recipes:
        if hasattr(recipe, "validate_options"):
            recipe.validate_options(request.options)
    stages = _Stages(progress, cancel, total=3 + 7 * len(recipes))
    out_dir = Path(request.out_dir)
    shared_timings: dict = {}

    started = stages.begin("loading the checkpoint")
    checkpoint = load_checkpoint(
        request.model, revision=request.revision, token=request.token, allow_pickle=request.allow_pickle,
        progress=progress,
    )
    stages.end(started, shared_timings, "load")
    check_context(checkpoint, request)
    from quant.schemes import check_group_size_fits

    for recipe in recipes:
        check_group_size_fits(recipe.quantization, recipe_options(recipe, request).get("group_size"), checkpoint.config)

    reference = eval_reference = None
    if request.generate:
        started = stages.begin("generating with the fp32 eager reference")
        reference_module = build_exportable(
            checkpoint.config, checkpoint.state_dict, ExportOptions(request.max_seq_len, attention="sdpa")
        )
        reference = _generate(gen.eager_step(reference_module), gen.ENGINE_EAGER_FP32, checkpoint, request)
        stages.end(started, shared_timings, "reference_generation")
        started = stages.begin("fp32 reference logits on the evaluation text")
        eval_ids = fidelity.eval_token_ids(checkpoint.tokenizer)
        eval_reference = (eval_ids,
                          fidelity.sequence_logits(gen.eager_step(reference_module), eval_ids, request.max_seq_len),
                          fidelity.targets_of(eval_ids, request.max_seq_len))
        stages.end(started, shared_timings, "reference_fidelity")
        del reference_module

    prepared: dict[tuple, tuple[torch.nn.Module, str]] = {}  # quantized module and the recipe that made it
    reports = []
    for recipe in recipes:
        recipe_dir = out_dir if len(recipes) == 1 else out_dir / recipe.name
        report = _run_recipe(recipe, checkpoint, request, reference, prepared, stages, shared_timings, recipe_dir,
                             eval_reference=eval_reference)
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
        generation_config=getattr(checkpoint, "generation_config", None),
    )


def _prepare(recipe: Recipe, checkpoint: Checkpoint, request: RunRequest, prepared: dict, stages: _Stages, timings: dict):
    """Quantized module (for eager generation) and ExportedProgram (for lowering), shared by every
    recipe that needs the same scheme, options and module shape."""
    from quant.schemes import SCHEMES
    from quant.calibration import calibration_inputs

    options = recipe_options(recipe, request)
    scheme = SCHEMES[recipe.quantization]
    export_options = ExportOptions(request.max_seq_len, attention=recipe.attention, dtype=recipe.dtype)
    # Source transforms depend on the group size only, so backends that differ in other options (SoC,
    # compute units) still share one quantization. PT2E quantizers depend on every option: never shared.
    key = (recipe.quantization, options.get("group_size"), export_options)
    if scheme.quantize_exported is None and key in prepared:
        # The quantized module is shared; the program is exported again, because lowering leaves
        # unbacked-symbol state in an ExportedProgram that makes a second lowering of it fail.
        module = prepared[key][0]
        timings["shared_quantization_with"] = prepared[key][1]
        started = stages.begin(f"exporting for {recipe.name}")
        program = export_program(module, request.max_seq_len)
        stages.end(started, timings, "export")
        return module, program
    module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options)
    started = stages.begin(f"quantizing ({recipe.quantization}) for {recipe.name}")
    apply_scheme(module, recipe.quantization, options.get("group_size"))
    stages.end(started, timings, "quantize")
    started = stages.begin(f"exporting for {recipe.name}")
    program = export_program(module, request.max_seq_len)
    stages.end(started, timings, "export")
    if scheme.quantize_exported is not None:
        started = stages.begin(f"calibrating and converting ({recipe.quantization}) for {recipe.name}")
        inputs = calibration_inputs(checkpoint.tokenizer, request.max_seq_len)
        # the program to lower, and the converted q/dq module whose eager run simulates it
        program, module = scheme.quantize_exported(program, inputs, options)
        stages.end(started, timings, "quantize")
        timings["calibration"] = {"prompts": len(inputs), "source": "quant/calibration.py built-in prompts"}
    else:
        prepared[key] = (module, recipe.name)
    return module, program


def recipe_options(recipe: Recipe, request: RunRequest) -> dict:
    return {**recipe.options, **{k: v for k, v in request.options.items() if k in recipe.options}}


def _run_recipe(recipe, checkpoint, request, reference, prepared, stages, shared_timings, recipe_dir: Path,
                eval_reference: tuple | None = None) -> dict:
    timings = dict(shared_timings)
    report = {
        "model": checkpoint.describe(),
        "recipe": {"name": recipe.name, "backend": recipe.backend, "quantization": recipe.quantization,
                   "options": recipe_options(recipe, request), "max_seq_len": request.max_seq_len},
        "versions": versions(),
        "threads": thread_policy.describe(),
        "timings_s": timings,
        "pte": None,
        "delegation": None,
        "generations": [reference.to_dict()] if reference else [],
        "fidelity": None,
        "errors": [],
    }
    module = lowered = None
    try:
        module, program = _prepare(recipe, checkpoint, request, prepared, stages, timings)
        started = stages.begin(f"lowering to {recipe.backend} ({recipe.name})")
        lowered = lower_to_pte(
            program,
            recipe.partitioners(report["recipe"]["options"]),
            transform_passes=recipe.transform_passes() if recipe.transform_passes else None,
            compile_config=recipe.edge_compile_config() if recipe.edge_compile_config else None,
            generate_etrecord=request.profile,
        )
        stages.end(started, timings, "lower")
        timings["lower"], timings["serialize"] = round(lowered.lower_s, 3), round(lowered.serialize_s, 3)
        report["delegation"] = lowered.delegation
    except Cancelled:
        raise
    except Exception as err:  # a failing backend must not take the other recipes down; the report says why
        report["errors"].append(_error("lower" if module is not None else "prepare", err))
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
        except Cancelled:
            raise
        except Exception as err:  # a measurement that fails does not withhold a good .pte; the report says why
            report["fidelity"] = {"error": _error("fidelity", err)}
    if lowered is not None and not report["errors"]:
        pte_path = recipe_dir / "model.pte"
        write_atomically(pte_path, lowered.pte)
        report["pte"] = {"path": str(pte_path), "bytes": len(lowered.pte),
                         "sha256": hashlib.sha256(lowered.pte).hexdigest()}
        if lowered.etrecord is not None:
            write_atomically(recipe_dir / profiling.ETRECORD_NAME, lowered.etrecord)
    started = stages.begin(f"profiling {recipe.name}")
    report.update(profiling.recipe_profile(report, recipe_dir, recipe.runtime_imports,
                                           lambda step: _generate(step, gen.ENGINE_RUNTIME, checkpoint, request),
                                           enabled=request.profile))
    stages.end(started, timings, "profile")
    timings["peak_rss_mb"] = peak_rss_mb()
    write_atomically(recipe_dir / "report.json", json.dumps(report, indent=2).encode())
    return report


def _recipe_engine(recipe, module, lowered, report) -> tuple:
    """(step, engine) for a recipe's generation and fidelity: the .pte on the runtime when it runs here
    (loaded once); otherwise the same quantized model in eager PyTorch (or the converted PT2E graph),
    labelled with the recipe's eager engine so it is never mistaken for the backend's output."""
    why_not = "lowering failed" if lowered is None else recipe.cannot_run_here()
    if why_not is None:
        return gen.runtime_step(gen.load_runtime_method(lowered.pte, recipe.runtime_imports)), gen.ENGINE_RUNTIME
    report["runtime_note"] = why_not
    return gen.eager_step(module), recipe.eager_engine


def _recipe_fidelity(recipe, step, engine, request, eval_reference) -> dict:
    eval_ids, reference_logits, targets = eval_reference
    logits = fidelity.sequence_logits(step, eval_ids, request.max_seq_len)
    return fidelity.fidelity_report(engine, recipe.quantization, reference_logits, logits, targets)


def _error(stage: str, err: Exception) -> dict:
    if isinstance(err, UserFacingError):
        return {"stage": stage, "message": str(err)}
    return {"stage": stage, "message": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=8)}


def summary_rows(summary: dict) -> list[dict]:
    """One row per recipe: the side-by-side table of the app and summary.json."""
    rows = []
    for report in summary["recipes"]:
        delegation = report.get("delegation") or {}
        runtime = [g for g in report["generations"] if g["engine"] != gen.ENGINE_EAGER_FP32]
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
