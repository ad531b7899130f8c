"""Run one or several recipes on one checkpoint: load once, quantize and export once per distinct
(scheme, module options), lower per recipe, generate, and write model.pte + report.json per recipe.
This is the function both `python -m recipes run` and the app call."""
from __future__ import annotations

import copy
import gc
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.sources.checkpoint import Checkpoint, load_checkpoint
from models.families import module_shape
from models.llama import ExportOptions, build_exportable, kv_cache_bytes
from models.module_options import ATTENTION_SINK_TOKENS
from quant.calibration_file import CalibrationFile
from quant.layer_error import eager_layer_outputs
from recipes.evaluation import fidelity
from recipes.running import llm_runner
from recipes.process import malloc_policy
from recipes.estimates import memory_estimate
from recipes.estimates.job_cost import JobEstimateCheck
from recipes.process import thread_policy
from recipes.running import generate as gen
from recipes.lowering import static_program
from recipes.running import profile as profiling
from recipes.files.atomic_write import write_atomically
from recipes.evaluation.layer_major_reference import layer_major_scores
from recipes.evaluation.layer_map import windows_of
from recipes.lowering.lower import LoweredProgram, Lowering, OutputWriteError
from recipes.pipeline.layer_outputs import recipe_layer_map
from recipes.pipeline.prepare import Made, Prepared, RecipeJob, Through, prepare_and_lower
from recipes.files.pte_program import PTD_NAME, PTE_NAME
from recipes.registry import Recipe, backend_packages, get_recipe
from recipes.output.report import (Fidelity, Generation, JobSummary, KvCache, LayerMap, LlmMetadata, Memory,
                            ModelInfo, Pte, RecipeInfo, Report, StageError, Threads, package_versions)
from recipes.request import (RunRequest, calibration_readers, check_limits, check_prompt_fits, preparation_key,
                             read_request_calibration, recipe_options, tokenized_calibration, validate_request)
from recipes.pipeline.stages import Cancelled, Figures, Progress, Stages, peak_rss_mb
from recipes.output.summary import REFERENCE_ENGINES as REFERENCE_ENGINE_NAMES, summary_rows
from recipes.files.tokenizer_files import tokenizer_files

# Above 2 GiB a single file passes a signed 32-bit size, which tools that take a file in one piece do not
# (a java.nio MappedByteBuffer on Android, a byte[] read); the program stays small and the weights go apart.
DATA_FILE_ABOVE_BYTES = 2**31
# The eager reference runs in fp32 when it fits, else in the checkpoint's own dtype (memory_estimate.py).
REFERENCE_ENGINES = dict(zip((torch.float32, torch.bfloat16, torch.float16), REFERENCE_ENGINE_NAMES))


@dataclass
class _Job:
    """What every recipe of a job shares."""
    request: RunRequest
    checkpoint: Checkpoint
    model: ModelInfo
    memory: JobEstimateCheck  # the job's estimate (memory, disk, time), checked against the memory it may use
    stages: Stages
    shared: Figures  # the stages before any recipe's
    versions: dict[str, str | None]
    tokenizer_files: dict[str, bytes]
    calibration_file: CalibrationFile | None = None  # tokenized; None: the built-in calibration
    calibration_heldout: list[int] = field(default_factory=list)  # its held-out slice's ids, when long enough
    reference: Generation | None = None
    eval_reference: fidelity.EvalReference | None = None
    prepared: dict[tuple, Prepared] = field(default_factory=dict)  # quantized modules a later recipe shares
    shared_s: float = 0.0  # the wall of the stages every recipe shares (loading, the reference)


def run(request: RunRequest, progress: Progress | None = None, cancel: threading.Event | None = None) -> JobSummary:
    """The job's summary; each recipe's report is also on disk."""
    started = time.perf_counter()
    thread_policy.torch_threads()
    malloc_policy.unmap_large_blocks()
    recipes = [get_recipe(name) for name in request.recipes]
    validate_request(request, recipes)
    options = {recipe.name: recipe_options(recipe, request.options) for recipe in recipes}
    calibration_file = read_request_calibration(request, recipes, options)
    stages, shared = Stages(progress, cancel, total=3 + 7 * len(recipes)), Figures()
    memory = JobEstimateCheck(recipes, request.max_seq_len, request.generate, options, request.layer_map)

    def check_config(config) -> None:  # before any weight is read or downloaded
        check_limits(config, recipes, request.max_seq_len, options)
        memory(config)

    with stages.stage("loading the checkpoint", shared, "load"):
        checkpoint = load_checkpoint(request.model, revision=request.revision, token=request.token,
                                     allow_pickle=request.allow_pickle, progress=progress, check_config=check_config,
                                     adapter=request.adapter, adapter_revision=request.adapter_revision)
    check_prompt_fits(checkpoint, request)
    calibration_file = tokenized_calibration(calibration_file, checkpoint.tokenizer, recipes, options)
    job = _Job(request, checkpoint, ModelInfo.from_dict(checkpoint.describe(), strict=True), memory, stages, shared,
               package_versions(backend_packages()), tokenizer_files(checkpoint.tokenizer), calibration_file)
    if calibration_file is not None:
        job.calibration_heldout = calibration_file.heldout_ids(max(calibration_readers(recipes, options).values()))
    if request.generate:
        _reference(job)
    job.shared_s = time.perf_counter() - started
    out_dir = Path(request.out_dir)
    reports = []
    for index, recipe in enumerate(recipes):
        needed_later = {preparation_key(later, options[later.name], request.max_seq_len)
                        for later in recipes[index + 1:]}
        recipe_dir = out_dir if len(recipes) == 1 else out_dir / recipe.name
        reports.append(_run_recipe(job, recipe, options[recipe.name], recipe_dir, needed_later))
    summary = JobSummary(job.model, job.reference, reports)
    if len(recipes) > 1:
        rows = json.dumps(summary_rows(summary), indent=2, ensure_ascii=False)
        write_atomically(out_dir / "summary.json", rows.encode())
    if progress:
        progress(1.0, "done")
    return summary


def _reference(job: _Job) -> None:
    """The eager reference's generation and its logits on the evaluation texts (with each decoder layer's output
    for the layer map): what every recipe is measured against."""
    request, checkpoint = job.request, job.checkpoint
    texts = (fidelity.EVAL_TEXT, fidelity.HELDOUT_TEXT)
    eval_ids = [fidelity.eval_token_ids(checkpoint.tokenizer, text) for text in texts]
    if job.calibration_heldout:
        eval_ids.append(job.calibration_heldout)  # scored by each recipe beside the two fixed texts
    if job.memory.estimate:  # again with the texts' token counts by this tokenizer, before the reference is built
        job.memory(checkpoint.config, [len(ids) for ids in eval_ids])
    estimate = job.memory.estimate
    reference_dtype, weight_dtype = memory_estimate.reference_dtypes(estimate)
    if weight_dtype != checkpoint.dtype:
        weight_dtype = None  # only weights stored in that dtype stay in it: a cast would round them
    engine = REFERENCE_ENGINES[reference_dtype]
    if estimate is not None and estimate.reference_layer_major:
        with job.stages.stage(f"{engine} reference logits on the evaluation texts, one layer at a time", job.shared,
                              "reference_fidelity"):
            scored = layer_major_scores(checkpoint.config, checkpoint.state_dict, eval_ids, request.max_seq_len)
            job.eval_reference = _eval_reference(job, engine, scored)
        return
    with job.stages.stage(f"generating with the {engine} reference", job.shared, "reference_generation"):
        module = build_exportable(
            checkpoint.config, checkpoint.state_dict,
            ExportOptions(request.max_seq_len, attention="sdpa", dtype=reference_dtype, weight_dtype=weight_dtype),
            tie_output=True,
        )
        job.reference = _generate(gen.eager_step(module), engine, job)
        if weight_dtype not in (None, reference_dtype):
            job.reference.weights_dtype = str(weight_dtype).replace("torch.", "")
    with job.stages.stage(f"{engine} reference logits on the evaluation texts", job.shared, "reference_fidelity"):
        scored = [fidelity.score_text(gen.eager_step(module), ids, request.max_seq_len) for ids in eval_ids]
        layers = (eager_layer_outputs(module, windows_of(eval_ids[0], request.max_seq_len)) if request.layer_map
                  else None)
        job.eval_reference = _eval_reference(job, engine, scored, layers)
    del module
    gc.collect()  # a parametrized module (models/compute_dtype.py) is freed by the cycle collector only


def _eval_reference(job: _Job, engine: str, scored: list[fidelity.ScoredText], layers=None) -> fidelity.EvalReference:
    """The reference's scores on both fixed texts and, when there is one, on the calibration file's held-out slice."""
    reference = fidelity.EvalReference(engine, *scored[:2], layers=layers)
    if job.calibration_heldout:
        reference.calibration_heldout = scored[2]
        reference.calibration_heldout_text = job.calibration_file.heldout_describe(len(job.calibration_heldout))
    return reference


def _generate(step, engine: str, job: _Job) -> Generation:
    request, checkpoint = job.request, job.checkpoint
    return gen.generate(step, engine, checkpoint.tokenizer, request.prompt, request.max_new_tokens,
                        request.max_seq_len, gen.Sampling(request.temperature, request.top_p),
                        stop_ids=checkpoint.eos_token_ids)


def kv_cache_section(recipe: Recipe, options: dict, config, max_seq_len: int) -> KvCache | None:
    """recipe.kv_cache, for a recipe that takes the KV cache options: the caches as its program holds them."""
    if "kv_cache" not in options:
        return None
    form = recipe.export_options(max_seq_len, options)
    return KvCache(dtype=options["kv_cache"], window=form.kv_window,
                   sink_tokens=ATTENTION_SINK_TOKENS if form.kv_window else None, rows=form.cache_rows,
                   bytes=kv_cache_bytes(module_shape(config), form), tokens_per_call=form.call_tokens)


def _run_recipe(job: _Job, recipe: Recipe, options: dict, recipe_dir: Path, needed_later: set[tuple]) -> Report:
    """One recipe from quantization to its report.json, assembled from what its stages returned and written once.
    A failing recipe records why in its report and ships no .pte; the job's other recipes still run."""
    request, started = job.request, time.perf_counter()
    figures = copy.deepcopy(job.shared)
    target = RecipeJob(recipe, options, job.checkpoint, request.max_seq_len, job.calibration_file)
    made, errors = _lower(job, target, recipe_dir, target.key in needed_later, figures)
    measured = _Measured()
    if request.generate and (made.module is not None or made.lowered is not None):
        measured = _generate_and_measure(job, target, made, figures)
    errors += measured.errors
    # The quantized module (unless a later recipe shares it) is released before the LLM runner and the profile
    # load the .pte again.
    made.module = None
    for key in [key for key in job.prepared if key not in needed_later]:
        del job.prepared[key]
    lowered, shipped = made.lowered, _Shipped()
    if lowered is not None and errors:
        for path in (lowered.pte_path, lowered.ptd_path):  # a recipe that failed later ships no .pte
            if path is not None:
                path.unlink(missing_ok=True)
    elif lowered is not None:
        shipped = _ship(job, recipe, lowered, recipe_dir, figures)
    generations = [*([job.reference] if job.reference else []), *shipped.generations, *measured.generations]
    with job.stages.stage(f"profiling {recipe.name}", figures, "profile"):
        if recipe.static_io and request.profile:
            profile, profile_note = None, static_program.PROFILE_NOTE
        else:
            profile, profile_note = profiling.recipe_profile(
                shipped.pte and Path(shipped.pte.path), recipe.backend.runtime_imports,
                lambda step: _generate(step, gen.ENGINE_RUNTIME, job), generated=bool(generations),
                runtime_note=measured.runtime_note, enabled=request.profile)
    figures.timings.peak_rss_mb = peak_rss_mb(figures.peaks)
    figures.timings.total = round(job.shared_s + time.perf_counter() - started, 1)
    estimate = job.memory.estimate
    figures.timings.estimate = estimate.recipe_time(recipe.name) if estimate else None
    report = Report(
        model=job.model,
        recipe=RecipeInfo(name=recipe.name, backend=recipe.backend.name, quantization=recipe.quantization,
                          options=made.described_options or dict(options), max_seq_len=request.max_seq_len,
                          runs_on=recipe.backend.runs_on,
                          kv_cache=kv_cache_section(recipe, options, job.checkpoint.config, request.max_seq_len)),
        versions=job.versions, threads=Threads.from_dict(thread_policy.describe(), strict=True),
        timings=figures.timings, pte=shipped.pte,
        llm_metadata=(LlmMetadata.from_dict(static_program.reported_metadata(made.metadata), strict=True)
                      if made.metadata is not None else None),
        delegation=lowered.delegation if lowered is not None else None,
        generations=generations, quantization=made.quantization, fidelity=measured.fidelity, errors=errors,
        generation_note=None if request.generate else
        "export only: no sample generations and no fidelity were asked for",
        runtime_note=measured.runtime_note, runner_note=shipped.runner_note, profile=profile,
        profile_note=profile_note,
        memory=Memory(peak_rss_mb_by_stage=figures.peaks, peak_rss_mb=figures.timings.peak_rss_mb,
                      estimate=estimate))
    write_atomically(recipe_dir / "report.json", report.to_json().encode())
    return report


def _lower(job: _Job, target: RecipeJob, recipe_dir: Path, shared_later: bool, figures: Figures
           ) -> tuple[Made, list[StageError]]:
    """The recipe's program lowered into recipe_dir/model.pte, with its quantized module while something runs it
    again; a failure returns what was made so far and the error."""
    request, recipe = job.request, target.recipe
    ptd_path = recipe_dir / PTD_NAME if writes_data_file(recipe, request, target.checkpoint.config) else None
    through = Through(job.stages, figures, job.prepared,
                      keep_module_while_lowering=request.generate or shared_later,
                      keep_module_after=shared_later or memory_estimate.module_runs_again(recipe, request.generate,
                                                                                          request.layer_map))
    made = Made()
    try:
        prepare_and_lower(target, Lowering(generate_etrecord=request.etrecord, pte_path=recipe_dir / PTE_NAME,
                                           ptd_path=ptd_path), through, made)
    except (Cancelled, OutputWriteError):
        raise
    except Exception as err:  # a failing backend must not take the other recipes down; the report says why
        return made, [StageError.of(made.stage, err)]
    return made, []


def writes_data_file(recipe: Recipe, request: RunRequest, config) -> bool:
    """Whether the recipe's weights go to a .ptd beside its .pte: where its backend can write one, when asked, or
    unasked when the program would pass DATA_FILE_ABOVE_BYTES."""
    if recipe.backend.named_data_context is None or request.weights_file is False:
        return False
    return bool(request.weights_file) or memory_estimate.pte_bytes(config, recipe) > DATA_FILE_ABOVE_BYTES


@dataclass
class _Measured:
    """What generating with a recipe and measuring it returned."""
    generations: list[Generation] = field(default_factory=list)
    fidelity: Fidelity | None = None
    runtime_note: str | None = None  # why the .pte did not run here
    errors: list[StageError] = field(default_factory=list)


def _generate_and_measure(job: _Job, target: RecipeJob, made: Made, figures: Figures) -> _Measured:
    """The recipe's sample generation, then its fidelity (and layer map) against the reference. The step loop's
    program is released on return."""
    request, recipe, measured, step = job.request, target.recipe, _Measured(), None
    try:
        with job.stages.stage(f"generating with {recipe.name}", figures, "generate"):
            generation_step, step, engine, measured.runtime_note = _recipe_engine(target, made)
            measured.generations.append(_generate(generation_step, engine, job))
    except Cancelled:
        raise
    except Exception as err:
        measured.errors.append(StageError.of("generate", err))
    if step is None or job.eval_reference is None:
        return measured
    reference = job.eval_reference
    try:
        with job.stages.stage(f"measuring fidelity of {recipe.name}", figures, "fidelity"):
            measured.fidelity = fidelity.recipe_fidelity(step, engine, recipe.quantization, request.max_seq_len,
                                                         reference)
        if request.layer_map:
            with job.stages.stage(f"mapping error per layer of {recipe.name}", figures, "layer_map"):
                measured.fidelity.layers = recipe_layer_map(engine, target, made, reference,
                                                            on_runtime=engine == gen.ENGINE_RUNTIME)
    except Cancelled:
        raise
    except Exception as err:  # a measurement that fails does not withhold a good .pte; the report says why
        if measured.fidelity is None:
            measured.fidelity = Fidelity(error=StageError.of("fidelity", err))
        else:
            measured.fidelity.layers = LayerMap(error=StageError.of("layer_map", err))
    return measured


def _recipe_engine(target: RecipeJob, made: Made) -> tuple:
    """(generation step, fidelity step, engine, why the .pte did not run here) for a recipe: the .pte on the
    runtime when it runs here (loaded once); otherwise the same quantized model in eager PyTorch (or the converted
    PT2E graph), labelled with the recipe's eager engine so it is never mistaken for the backend's output. The two
    steps differ for a static program only, whose generation prefills by chunks and keeps the last logits."""
    recipe, lowered, backend = target.recipe, made.lowered, target.recipe.backend
    why_not = "lowering failed" if lowered is None else backend.cannot_run_here()
    if recipe.static_io:
        session = (static_program.runtime_session(lowered.pte_path) if why_not is None else
                   static_program.eager_session(made.module, int(target.options["prefill_chunk"])))
        return (session.last_step, session.step, gen.ENGINE_RUNTIME if why_not is None else backend.eager_engine,
                why_not)
    if why_not is None:
        step = gen.runtime_step(gen.load_runtime_method(lowered.pte_path, backend.runtime_imports))
        return step, step, gen.ENGINE_RUNTIME, None
    step = gen.eager_step(made.module)
    return step, step, backend.eager_engine, why_not


@dataclass
class _Shipped:
    """What shipping a recipe's folder returned: its pte section, ExecuTorch's LLM runner's generation (or why
    none)."""
    pte: Pte | None = None
    generations: list[Generation] = field(default_factory=list)
    runner_note: str | None = None


def _ship(job: _Job, recipe: Recipe, lowered: LoweredProgram, recipe_dir: Path, figures: Figures) -> _Shipped:
    """A finished recipe's folder: the .pte's section, the tokenizer files, ExecuTorch's LLM runner on them where
    the .pte runs here, and the ETRecord when asked for."""
    shipped = _Shipped(Pte(path=str(lowered.pte_path), bytes=lowered.pte_bytes, sha256=lowered.pte_sha256))
    if lowered.ptd_path is not None:
        shipped.pte.ptd_path, shipped.pte.ptd_bytes, shipped.pte.ptd_sha256 = (
            str(lowered.ptd_path), lowered.ptd_bytes, lowered.ptd_sha256)
    for name, data in job.tokenizer_files.items():
        write_atomically(recipe_dir / name, data)
    if recipe.static_io:
        write_atomically(recipe_dir / static_program.RUNNER_NAME, static_program.runner_source())
        shipped.runner_note = static_program.runner_note(recipe.backend.cannot_run_here())
    elif job.request.generate and recipe.backend.cannot_run_here() is None:
        with job.stages.stage(f"generating with ExecuTorch's LLM runner ({recipe.name})", figures, "runner_generate"):
            request, checkpoint = job.request, job.checkpoint
            generation, shipped.runner_note = llm_runner.runner_generation(
                recipe_dir / PTE_NAME, recipe_dir / "tokenizer.json", checkpoint.tokenizer, request.prompt,
                request.max_new_tokens, temperature=request.temperature, eos_token_ids=checkpoint.eos_token_ids,
                runtime_imports=recipe.backend.runtime_imports)
        if generation is not None:  # before the step loop's, which stays for fidelity
            shipped.generations.append(generation)
    if lowered.etrecord is not None:
        write_atomically(recipe_dir / profiling.ETRECORD_NAME, lowered.etrecord)
    return shipped
