"""A recipe's quantized module (for eager generation) and ExportedProgram (for lowering). Recipes that need the same
scheme, options and module shape share one quantization (request.preparation_key)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from models.sources.checkpoint import Checkpoint
from models.errors import UserFacingError
from models.llama import build_exportable
from quant.calibration import calibration_inputs
from quant.quantize import UnitQuantizer, cast_quantized, quantize_module, quantizes_by_unit
from quant.schemes import SCHEMES
from recipes.process import malloc_policy
from recipes.lowering.lower import export_program
from recipes.registry import Recipe
from recipes.lowering.static_program import export_methods, static_form
from recipes.output.report import Pt2eCalibration, Quantization
from recipes.request import preparation_key
from recipes.pipeline.stages import Figures, Stages


@dataclass
class Prepared:
    """A quantized module kept for the later recipes that share it."""
    module: torch.nn.Module
    made_by: str  # the recipe that quantized it
    quantization: Quantization


def prepare(recipe: Recipe, options: dict, checkpoint: Checkpoint, max_seq_len: int,
            prepared: dict[tuple, Prepared], stages: Stages, figures: Figures
            ) -> tuple[torch.nn.Module, torch.export.ExportedProgram, Quantization]:
    """(module, program, its quantization section); a module another recipe may share lands in `prepared`."""
    scheme = SCHEMES[recipe.quantization]
    key = preparation_key(recipe, options, max_seq_len)
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
        module, quantization = _quantized_module(recipe, options, checkpoint, max_seq_len, figures)
        if recipe.static_io:
            module = static_form(module, options)
    with stages.stage(f"exporting for {recipe.name}", figures, "export"):
        program = _export(recipe, module, options, max_seq_len)
    if scheme.quantize_exported is not None:
        with stages.stage(f"calibrating and converting ({recipe.quantization}) for {recipe.name}", figures,
                          "quantize"):
            inputs = calibration_inputs(checkpoint.tokenizer, max_seq_len)
            program, module = quantize_exported(recipe, program, inputs, options, max_seq_len)
        figures.timings.calibration = Pt2eCalibration(prompts=len(inputs),
                                                      source="quant/calibration.py built-in prompts")
    else:
        prepared[key] = Prepared(module, recipe.name, quantization)
    return module, program, quantization


def _export(recipe: Recipe, module: torch.nn.Module, options: dict, max_seq_len: int):
    """The recipe's program: one with a dynamic token dimension, or a static recipe's {prefill, decode}."""
    if recipe.static_io:
        return export_methods(module, int(options["prefill_chunk"]), strict=recipe.backend.strict_export)
    return export_program(module, max_seq_len, strict=recipe.backend.strict_export)


def _quantized_module(recipe: Recipe, options: dict, checkpoint: Checkpoint, max_seq_len: int, figures: Figures
                      ) -> tuple[torch.nn.Module, Quantization]:
    """The module built from the checkpoint and quantized; the seconds of the quantization's parts land in
    `figures`."""
    export_options = recipe.export_options(max_seq_len, options)
    if quantizes_by_unit(recipe.quantization, options):
        # the quantized units kept between AWQ's searches must not pin the blocks a search frees
        quantizer = UnitQuantizer(recipe.quantization, options, checkpoint.tokenizer, max_seq_len,
                                  around_search=malloc_policy.reusing_large_blocks,
                                  around_scheme=malloc_policy.keeping_freed_heap)
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options, transform_unit=quantizer,
                                  output_first=True)
        section, seconds = quantizer.section(module), quantizer.seconds
    else:
        module = build_exportable(checkpoint.config, checkpoint.state_dict, export_options)
        with malloc_policy.reusing_large_blocks():  # AWQ's and mixed precision's passes over the calibration text
            section, seconds = quantize_module(module, recipe.quantization, options, checkpoint.tokenizer, max_seq_len)
    figures.timings.add_parts(seconds)
    return cast_quantized(module, recipe.quantization), Quantization.from_dict(section, strict=True)


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
