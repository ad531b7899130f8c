"""Each decoder layer's output of a recipe's model on the evaluation windows, for its per-layer error map. Where
the .pte runs here, ExecuTorch's intermediate-output tap makes the lowered program return every layer's output as an
extra output (inside the XNNPACK delegate too): the recipe's quantized module goes through prepare_and_lower again,
tapped, and the program runs on the runtime. Otherwise eager forward hooks on the quantized module give the same
tensors, labelled with the eager engine."""
from __future__ import annotations

import torch

from quant.layer_error import eager_layer_outputs, in_reference_basis
from recipes.evaluation import fidelity
from recipes.evaluation.layer_map import decoder_layer_outputs, layer_map, windows_of
from recipes.lowering.lower import Lowering
from recipes.output.report import LayerMap
from recipes.pipeline.prepare import Made, Prepared, RecipeJob, Through, prepare_and_lower
from recipes.running.generate import load_runtime_method


def recipe_layer_map(engine: str, target: RecipeJob, made: Made, reference: fidelity.EvalReference,
                     on_runtime: bool) -> LayerMap:
    """fidelity.layers of the recipe's model (made.module, lowered as made.lowered), against the reference's layer
    outputs on the same windows."""
    windows = windows_of(reference.eval.ids, target.max_seq_len)
    if on_runtime:
        outputs = runtime_layer_outputs(target, made, windows)
        method = "ExecuTorch intermediate_output_tap on the lowered program, run on the runtime"
    elif not hasattr(made.module, "model"):
        raise ValueError("no per-layer map of a PT2E-converted graph: its decoder layers are no longer modules")
    else:
        outputs = eager_layer_outputs(made.module, windows)
        method = "eager forward hooks on the quantized module"
    return layer_map(engine, method, reference.layers, outputs)


def runtime_layer_outputs(target: RecipeJob, made: Made, windows: list[torch.Tensor]) -> list[torch.Tensor]:
    """The recipe's quantized module exported again with a tap on each decoder layer's output, lowered with the
    recipe's backend and run on the runtime over `windows`."""
    from executorch.devtools.intermediate_output_tap import FULL_TENSOR, strip_taps_, tap_intermediate_outputs_

    specs = []

    def tap(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
        names = set(decoder_layer_outputs(program))
        program, tapped = tap_intermediate_outputs_(program, (lambda node: node.name in names, FULL_TENSOR))
        specs.extend(tapped)
        return program

    shared = {target.key: Prepared(made.module, target.recipe.name, made.quantization)}
    tapped = prepare_and_lower(target, Lowering(before_serialize=strip_taps_),
                               Through(prepared=shared, program_pass=tap))
    _program, method = load_runtime_method(tapped.lowered.pte, target.recipe.backend.runtime_imports)
    captured: list[list[torch.Tensor]] = [[] for _ in specs]
    for tokens in windows:
        outputs = method.execute([tokens, torch.tensor([0], dtype=torch.long)])
        for i, spec in enumerate(specs):
            captured[i].append(outputs[spec.output_index][0].float().clone())
    return in_reference_basis(made.module, [torch.cat(chunks) for chunks in captured])
