"""The one way from a checkpoint to a recipe's lowered program: build the module from the checkpoint, quantize it,
export it and lower it with the recipe's backend (`prepare_and_lower`). The job (recipes/pipeline/run.py), the
per-layer error map and the tests all go through it. Recipes that need the same scheme, options and module shape
share one quantization (request.preparation_key)."""
from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field
from typing import Callable

import torch

from models.sources.checkpoint import Checkpoint
from models.errors import UserFacingError
from models.llama import build_exportable
from models.prompting import stop_token_ids
from quant.calibration import calibration_inputs, describe_calibration, file_calibration_inputs
from quant.calibration_file import CalibrationFile
from quant.quantize import UnitQuantizer, cast_quantized, quantize_module, quantizes_by_unit
from quant.schemes import SCHEMES
from recipes.process import malloc_policy
from recipes.process.collector_policy import collector_skipping_older_objects
from recipes.lowering import kv_io_program, static_program
from recipes.lowering.llm_metadata import llm_metadata
from recipes.lowering.lower import LoweredProgram, Lowering, export_program, lower_for_backend
from recipes.registry import Recipe
from recipes.lowering.static_program import export_methods, static_form
from recipes.output.report import Pt2eCalibration, QuantCalibration, Quantization
from recipes.request import preparation_key
from recipes.pipeline.stages import Figures, Stages


@dataclass(frozen=True)
class RecipeJob:
    """What one recipe's program is made from: the recipe, its options (request.recipe_options), the checkpoint,
    the context the program is made for and the user's tokenized calibration file, if any (one per job, so it
    takes no part in which recipes share a quantization)."""
    recipe: Recipe
    options: dict
    checkpoint: Checkpoint
    max_seq_len: int
    calibration_file: CalibrationFile | None = None

    @property
    def key(self) -> tuple:
        return preparation_key(self.recipe, self.options, self.max_seq_len)


@dataclass
class Prepared:
    """A quantized module kept for the later recipes that share it."""
    module: torch.nn.Module
    made_by: str  # the recipe that quantized it
    quantization: Quantization


@dataclass
class Through:
    """How a job goes through prepare_and_lower: its stages (progress, cancellation, each stage's figures), the
    quantized modules its recipes share, whether the quantized module must outlive the lowering (an eager
    fallback if lowering fails, a later recipe that shares it) and the lowered program (eager generation, the
    layer map), and a pass on the exported program before it is lowered (the layer map's taps)."""
    stages: Stages = field(default_factory=lambda: Stages(None, None, total=1))
    figures: Figures = field(default_factory=Figures)
    prepared: dict[tuple, Prepared] = field(default_factory=dict)
    keep_module_while_lowering: bool = True
    keep_module_after: bool = True
    program_pass: Callable[[torch.export.ExportedProgram], torch.export.ExportedProgram] | None = None


@dataclass
class Made:
    """What prepare_and_lower made: the quantized module (None once released), its quantization section, the recipe
    options with what the backend says of its compile target (a report's recipe.options), the LLM metadata written
    into the .pte and the lowered program. When it raised, what it had made by then, and `stage` says where it
    stopped."""
    module: torch.nn.Module | None = None
    described_options: dict | None = None
    quantization: Quantization | None = None
    metadata: dict | None = None
    lowered: LoweredProgram | None = None
    stage: str = "prepare"


def prepare_and_lower(job: RecipeJob, lowering: Lowering = Lowering(), through: Through | None = None,
                      made: Made | None = None) -> Made:
    """The recipe's program made from the checkpoint and lowered as `lowering` says (its constant methods are the
    LLM metadata). Pass `made` to keep what was made when it raises."""
    through = through if through is not None else Through()
    made = made if made is not None else Made()
    recipe, checkpoint, figures = job.recipe, job.checkpoint, through.figures
    with collector_skipping_older_objects():
        made.module, program, made.quantization = _prepare(job, through)
    made.stage = "lower"
    with through.stages.stage(f"lowering to {recipe.backend.title} ({recipe.name})", figures, "lower"):
        made.described_options = {**job.options, **recipe.backend.describe_options(job.options)}
        stops = stop_token_ids(checkpoint.tokenizer, checkpoint.eos_token_ids)
        methods = recipe.backend.kv_io_methods(job.options, job.max_seq_len)
        if methods:
            made.metadata = kv_io_program.kv_io_metadata(made.module, methods, checkpoint.config,
                                                         checkpoint.tokenizer, stops)
        else:
            made.metadata = llm_metadata(program[static_program.DECODE] if recipe.static_io else program,
                                         job.max_seq_len, checkpoint.config, checkpoint.tokenizer, stops)
        if recipe.static_io:
            made.metadata.update(static_program.static_metadata(made.module, int(job.options["prefill_chunk"])))
        if not through.keep_module_while_lowering:
            # Nothing runs the module again: the program's weights are its only copy, released once lowered.
            through.prepared.pop(job.key, None)
            made.module = None
        if through.program_pass is not None:
            program = through.program_pass(program)
        made.lowered = lower_for_backend(program, recipe, job.options, dataclasses.replace(
            lowering, constant_methods=made.metadata, consume_program=True,
            free_weights_as_packed=made.module is None,
            caller_allocates_io=bool(methods) or recipe.static_io))
    lowered = made.lowered
    figures.timings.lower, figures.timings.serialize = round(lowered.lower_s, 3), round(lowered.serialize_s, 3)
    figures.peaks.update(lower=lowered.lower_peak_rss_mb, serialize=lowered.serialize_peak_rss_mb)
    del program  # the lowered program is in the .pte now
    if made.module is not None and not through.keep_module_after:
        through.prepared.pop(job.key, None)
        made.module = None
    # The export and lowering graphs are reference cycles: collected now, their memory is reused by the
    # runtime's load of the .pte instead of adding to it.
    gc.collect()
    malloc_policy.trim_freed_heap()
    return made


def _prepare(job: RecipeJob, through: Through) -> tuple[torch.nn.Module, torch.export.ExportedProgram, Quantization]:
    """(module, program, its quantization section); a module another recipe may share lands in `through.prepared`."""
    recipe, options, max_seq_len = job.recipe, job.options, job.max_seq_len
    stages, figures, prepared = through.stages, through.figures, through.prepared
    scheme = SCHEMES[recipe.quantization]
    key = job.key
    if scheme.quantize_exported is None and key in prepared:
        # The quantized module is shared; the program is exported again, because lowering leaves
        # unbacked-symbol state in an ExportedProgram that makes a second lowering of it fail.
        shared = prepared[key]
        figures.timings.shared_quantization_with = shared.made_by
        with stages.stage(f"exporting for {recipe.name}", figures, "export"):
            program = _export(recipe, shared.module, options, max_seq_len)
        return shared.module, program, shared.quantization
    with stages.stage(f"quantizing ({recipe.quantization}) for {recipe.name}, reading its weights", figures,
                      "quantize"):
        module, quantization = _quantized_module(job, figures)
        if recipe.static_io:
            module = static_form(module, options)
    with stages.stage(f"exporting for {recipe.name}", figures, "export"):
        program = _export(recipe, module, options, max_seq_len)
    if scheme.quantize_exported is not None:
        with stages.stage(f"calibrating and converting ({recipe.quantization}) for {recipe.name}", figures,
                          "quantize"):
            inputs = _pt2e_inputs(job)
            program, module = quantize_exported(recipe, program, inputs, options, max_seq_len, module=module)
        figures.timings.calibration = Pt2eCalibration(prompts=len(inputs), source=_pt2e_source(job, inputs))
        if job.calibration_file is not None and quantization.calibration is None:
            quantization.calibration = QuantCalibration.from_dict(
                describe_calibration([tokens for tokens, _ in inputs], file=job.calibration_file), strict=True)
    else:
        prepared[key] = Prepared(module, recipe.name, quantization)
    return module, program, quantization


def _pt2e_inputs(job: RecipeJob) -> list:
    """The calls a PT2E scheme's observers see: the built-in prompts, or windows of the calibration file."""
    if job.calibration_file is None:
        return calibration_inputs(job.checkpoint.tokenizer, job.max_seq_len)
    call_tokens = job.recipe.export_options(job.max_seq_len, job.options).call_tokens
    return file_calibration_inputs(job.calibration_file, min(call_tokens, job.max_seq_len - 1))


def _pt2e_source(job: RecipeJob, inputs: list) -> str:
    if job.calibration_file is None:
        return "quant/calibration.py built-in prompts"
    tokens = sum(tokens.shape[1] for tokens, _ in inputs)
    return f"{job.calibration_file.describe}: its first {tokens} tokens, one call a window"


def _export(recipe: Recipe, module: torch.nn.Module, options: dict, max_seq_len: int):
    """The recipe's program: one with a dynamic token dimension, or a static recipe's {prefill, decode}, or a
    KV-I/O backend's {prefill method, decode method}."""
    methods = recipe.backend.kv_io_methods(options, max_seq_len)
    if methods:
        return kv_io_program.export_methods(kv_io_program.kv_io_form(module), methods,
                                            strict=recipe.backend.strict_export)
    if recipe.static_io:
        return export_methods(module, int(options["prefill_chunk"]), strict=recipe.backend.strict_export)
    return export_program(module, max_seq_len, strict=recipe.backend.strict_export)


def _quantized_module(job: RecipeJob, figures: Figures) -> tuple[torch.nn.Module, Quantization]:
    """The module built from the checkpoint and quantized; the seconds of the quantization's parts land in
    `figures`."""
    recipe, options, checkpoint, max_seq_len = job.recipe, job.options, job.checkpoint, job.max_seq_len
    export_options = recipe.export_options(max_seq_len, options)
    if quantizes_by_unit(recipe.quantization, options):
        # the quantized units kept between AWQ's searches must not pin the blocks a search frees
        quantizer = UnitQuantizer(recipe.quantization, options, checkpoint.tokenizer, max_seq_len,
                                  around_search=malloc_policy.reusing_large_blocks,
                                  around_scheme=malloc_policy.keeping_freed_heap,
                                  calibration_file=job.calibration_file)
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options, transform_unit=quantizer,
                                  output_first=True)
        section, seconds = quantizer.section(module), quantizer.seconds
    else:
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options)
        with malloc_policy.reusing_large_blocks():  # AWQ's and mixed precision's passes over the calibration text
            section, seconds = quantize_module(module, recipe.quantization, options, checkpoint.tokenizer, max_seq_len,
                                               job.calibration_file)
    figures.timings.add_parts(seconds)
    return cast_quantized(module, recipe.quantization), Quantization.from_dict(section, strict=True)


def quantize_exported(recipe: Recipe, program, calibration, options: dict, max_seq_len: int,
                      module: torch.nn.Module | None = None):
    """A PT2E scheme with the recipe's backend's quantizer: (the program to lower, the converted q/dq
    module whose eager run simulates it). For a KV-I/O backend's {method: program} (module: the float module
    they were exported from): ({method: program}, the simulation that runs them as their runner does)."""
    backend = recipe.backend
    if backend.pt2e_quantizer is None:
        raise UserFacingError(f"{backend.name} has no PT2E quantizer for {recipe.quantization}.")
    if isinstance(program, dict):
        methods = backend.kv_io_methods(options, max_seq_len)
        form = kv_io_program.kv_io_form(module)
        programs, simulation = kv_io_program.quantize_methods(
            form, program, methods, calibration,
            lambda graph_module: backend.pt2e_quantizer(recipe.quantization, options, graph_module))
        if backend.pt2e_program_passes is not None:
            programs = {name: backend.pt2e_program_passes(each, recipe.quantization) for name, each in programs.items()}
        return programs, simulation
    program, module = SCHEMES[recipe.quantization].quantize_exported(
        program, calibration, lambda graph_module: backend.pt2e_quantizer(recipe.quantization, options, graph_module),
        backend.static_tokens, max_seq_len,
    )
    if backend.pt2e_program_passes is not None:
        program = backend.pt2e_program_passes(program, recipe.quantization)
    return program, module
