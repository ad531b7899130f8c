"""quant/algorithms.py is the one place an algorithm is added: a record registered there alone reaches the
schemes, both quantization paths, the report, the memory estimate, the CLI's help and the app's dropdown."""
import re

import pytest
import torch

from quant.algorithms import ALGORITHMS, Algorithm

DOUBLED = "doubled-norm"
INPUT_NORM = "model.layers.0.input_layernorm.weight"


def _double_input_norm(layer) -> None:
    """x2 in the norm before attention, /2 in the linears reading it: exact in fp32, and seen in the norm, which
    stays float."""
    from quant.awq import layer_linears

    layer.input_layernorm.weight.data = layer.input_layernorm.weight * 2
    for linear in layer_linears(layer)["attention_in"]:
        linear.weight.data = linear.weight / 2


def _double_every_input_norm(module, search_config, windows) -> None:
    for layer in module.model.layers:
        _double_input_norm(layer)


def _double_input_norms_as_built(search_config, windows):
    def transform(unit, module) -> None:
        if any(unit is layer for layer in module.model.layers):
            _double_input_norm(unit)

    return transform


def _register(monkeypatch, by_unit: bool) -> None:
    monkeypatch.setitem(ALGORITHMS, DOUBLED, Algorithm(
        DOUBLED, "each input norm doubled, its linears halved", prepare_module=_double_every_input_norm,
        prepare_by_unit=_double_input_norms_as_built if by_unit else None))


def _build(tiny_checkpoint, transform_unit=None):
    from models.llama import build_exportable
    from recipes.registry import get_recipe

    return build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict,
                            get_recipe("xnnpack-8da4w").export_options(64), transform_unit=transform_unit)


def _doubled(module, tiny_checkpoint) -> bool:
    return torch.equal(module.state_dict()[INPUT_NORM], 2 * tiny_checkpoint.state_dict[INPUT_NORM].to(torch.float32))


def test_a_registered_algorithm_runs_its_transform_on_the_whole_model_and_piece_by_piece(tiny_checkpoint, monkeypatch):
    from quant.quantize import UnitQuantizer, check_options, quantize_module, quantizes_by_unit
    from quant.schemes import SCHEMES, scheme_options

    _register(monkeypatch, by_unit=True)
    options = {"quant_algorithm": DOUBLED}
    check_options("8da4w", options)
    assert SCHEMES["8da4w"].algorithms[-1] == DOUBLED and scheme_options("8da4w")["quant_algorithm"] == "awq"
    assert quantizes_by_unit("8da4w", options)

    whole = _build(tiny_checkpoint)
    section, seconds = quantize_module(whole, "8da4w", options, tiny_checkpoint.tokenizer, 64)
    quantizer = UnitQuantizer("8da4w", options, tiny_checkpoint.tokenizer, 64)
    by_unit = _build(tiny_checkpoint, transform_unit=quantizer)

    assert section["algorithm"] == DOUBLED and quantizer.section(by_unit) == section
    assert "calibration" not in section and "quant_algorithm" in seconds and "quant_algorithm" in quantizer.seconds
    assert _doubled(whole, tiny_checkpoint) and _doubled(by_unit, tiny_checkpoint)
    by_unit_state, whole_state = by_unit.state_dict(), whole.state_dict()
    for name, tensor in by_unit_state.items():
        values = tensor.dequantize() if hasattr(tensor, "dequantize") else tensor
        expected = whole_state[name].dequantize() if hasattr(whole_state[name], "dequantize") else whole_state[name]
        assert torch.equal(values, expected), name


def test_a_transform_without_a_by_unit_form_takes_the_whole_model_path(tiny_checkpoint, monkeypatch):
    """The path that builds the module piece by piece never sees the whole module: it refuses such an algorithm
    rather than skip its transform, and the memory estimate counts the whole float model for it."""
    from bench.scale_models import CONFIGS
    from quant.quantize import UnitQuantizer, quantize_module, quantizes_by_unit
    from recipes.estimates.memory_estimate import estimate_job
    from recipes.registry import get_recipe
    from transformers import LlamaConfig

    _register(monkeypatch, by_unit=False)
    options = {"quant_algorithm": DOUBLED}
    assert ALGORITHMS[DOUBLED].whole_model and not quantizes_by_unit("8da4w", options)
    with pytest.raises(ValueError, match="whole float module"):
        UnitQuantizer("8da4w", options, tiny_checkpoint.tokenizer, 64)
    module = _build(tiny_checkpoint)
    section, _ = quantize_module(module, "8da4w", options, tiny_checkpoint.tokenizer, 64)
    assert section["algorithm"] == DOUBLED and _doubled(module, tiny_checkpoint)

    config, recipe = LlamaConfig(**CONFIGS["llama-3.2-1b"]), get_recipe("xnnpack-8da4w")

    def quantize_stage(algorithm: str) -> int:
        options = {recipe.name: {"quant_algorithm": algorithm}}
        return estimate_job(config, [recipe], 256, False, options=options).recipes[0].stages["quantize"]

    assert quantize_stage(DOUBLED) == quantize_stage("spinquant") > quantize_stage("hqq")


def test_a_by_unit_transform_without_its_whole_module_form_is_refused():
    with pytest.raises(ValueError, match="whole-module form"):
        Algorithm("by-unit-only", "a transform made only as the module is built",
                  prepare_by_unit=_double_input_norms_as_built)


def test_the_schemes_offer_what_they_did_with_the_same_defaults_and_paths():
    from quant.schemes import SCHEMES

    every = ("awq", "hqq", "minmax", "spinquant", "gptq", "awq-gptq")
    offered = {name: spec.algorithms for name, spec in SCHEMES.items()}
    # c4w (one int4 scale per output channel): GPTQ here chooses integers group by group; minmax measured best
    assert offered == {"8da4w": every, "8da4w-emb4": every, "int4-weight": every, "16a4w": ("awq", "minmax"),
                       "c4w": ("minmax", "awq", "hqq", "spinquant"),
                       **{name: ("minmax",) for name in ("fp32", "int8-weight", "8da8w", "fp16", "p4w", "16a8w", "8a8w")}}
    assert [name for name, a in ALGORITHMS.items() if a.whole_model] == ["spinquant", "gptq", "awq-gptq"]
    assert [name for name, a in ALGORITHMS.items() if a.calibrated] == ["awq", "gptq", "awq-gptq"]
    assert [name for name, a in ALGORITHMS.items() if a.prepare_by_unit] == ["awq"]


def _help_names(text: str) -> list[str]:
    return re.findall(r"(?:\. |; )([\w-]+): ", text)


def test_the_cli_help_and_the_app_dropdown_list_exactly_the_tables_algorithms(monkeypatch):
    from app import quant_algorithm_choices
    from recipes.__main__ import _parser, quant_algorithm_help

    run = next(action for action in _parser()._actions if action.dest == "command").choices["run"]
    (option,) = [action for action in run._actions if action.dest == "quant_algorithm"]
    assert option.help == quant_algorithm_help()
    for registered in (False, True):
        if registered:
            _register(monkeypatch, by_unit=True)
        assert _help_names(quant_algorithm_help()) == list(ALGORITHMS)
        assert all(f"{name}: {a.description}" in quant_algorithm_help() for name, a in ALGORITHMS.items())
        choices = quant_algorithm_choices()
        assert [value for _label, value in choices] == ["", *ALGORITHMS]
        assert choices[0][0].startswith("each scheme's default (8da4w: awq, ")
        assert [label for label, _value in choices[1:]] == [f"{name} — {a.description}" for name, a in ALGORITHMS.items()]


def test_the_apps_dropdown_shows_those_choices():
    import gradio as gr

    from app import quant_algorithm_choices, quant_controls

    with gr.Blocks():
        algorithm, _budget, _layer_map = quant_controls()
    assert [tuple(choice) for choice in algorithm.choices] == quant_algorithm_choices()
