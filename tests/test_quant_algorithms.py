"""Quant algorithms (minmax, hqq, awq, spinquant, gptq, awq-gptq), the calibration and evaluation texts, mixed precision."""
import re

import pytest
import torch

from models.errors import UserFacingError


@pytest.fixture(scope="module")
def random_llama():
    """A random Llama as wide as group-wise int4 needs to show differences (hidden 128, two layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    state_dict = LlamaForCausalLM(config).state_dict()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (1, 60), generator=generator)
    calibration = (torch.randint(0, 300, (1, 60), generator=generator),)
    return config, state_dict, tokens, calibration


def _calibration(random_llama, algorithm):
    """GPTQ reads the whole calibration text, more tokens than its Hessians (up to 256 wide here) are wide:
    ten windows. The others read one."""
    from quant.algorithms import ALGORITHMS

    if not ALGORITHMS[algorithm].gptq_integers:
        return random_llama[3]
    generator = torch.Generator().manual_seed(2)
    return tuple(torch.randint(0, 300, (1, 60), generator=generator) for _ in range(10))


# The fused q/k/v form (XNNPACK's) and the separate one (every other backend's).
FUSED = dict(attention="custom", norm="linear-mean", fuse_qkv=True)


def _module_form(attention: str) -> dict:
    return FUSED if attention == "custom" else dict(attention=attention)


def _logits_error(random_llama, algorithm, group_size=32, attention="custom", calibration=None):
    """Relative squared error of 8da4w logits against fp32 on a fixed input."""
    from models.llama import ExportOptions, build_exportable
    from quant.schemes import apply_scheme

    config, state_dict, tokens, _ = random_llama

    def logits(module):
        module.reset_cache()
        with torch.no_grad():
            return module(tokens, torch.tensor([0]))

    reference = logits(build_exportable(config, state_dict, ExportOptions(64, **_module_form(attention))))
    module = build_exportable(config, state_dict, ExportOptions(64, **_module_form(attention)))
    apply_scheme(module, "8da4w", group_size, algorithm, calibration or _calibration(random_llama, algorithm))
    return ((logits(module) - reference).pow(2).mean() / reference.pow(2).mean()).item()


def _assert_no_worse_than_minmax(error, minmax_error):
    assert error <= minmax_error, (error, minmax_error)


@pytest.mark.parametrize("attention", ["custom", "sdpa"])
@pytest.mark.parametrize("algorithm", ["hqq", "awq", "spinquant", "gptq", "awq-gptq"])
def test_each_algorithm_is_no_worse_than_minmax(random_llama, algorithm, attention):
    """custom: XNNPACK's fused q/k/v form; sdpa: three linears (Core ML's int4-weight takes that form)."""
    _assert_no_worse_than_minmax(_logits_error(random_llama, algorithm, attention=attention),
                                 _logits_error(random_llama, "minmax", attention=attention))


def test_the_comparison_fails_on_a_worse_setting(random_llama):
    """Groups of 128 instead of 32: the same check must refuse it."""
    with pytest.raises(AssertionError):
        _assert_no_worse_than_minmax(_logits_error(random_llama, "hqq", group_size=128),
                                     _logits_error(random_llama, "minmax"))


def test_gptq_on_fewer_tokens_than_its_hessians_are_wide_fails_the_comparison(random_llama):
    """One 60-token window for Hessians up to 256 wide: GPTQ fits the calibration tokens, not the model."""
    with pytest.raises(AssertionError):
        _assert_no_worse_than_minmax(_logits_error(random_llama, "gptq", calibration=random_llama[3]),
                                     _logits_error(random_llama, "minmax"))


def _first_layers_inputs(random_llama) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each linear group of the tiny Llama's first decoder layer (its rows one after the other) and what it reads
    on the calibration text, [tokens, channels]: the attention's input, the MLP's and down_proj's."""
    from models.llama import ExportOptions, build_exportable
    from quant.awq import layer_linears

    config, state_dict, _tokens, calibration = random_llama
    module = build_exportable(config, state_dict, ExportOptions(64, **FUSED))
    groups = layer_linears(module.model.layers[0]).values()
    seen = []
    hooks = [group[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].reshape(-1, args[0].shape[-1])))
             for group in groups]
    with torch.no_grad():
        module(calibration[0], torch.tensor([0]))
    for hook in hooks:
        hook.remove()
    return [(torch.cat([linear.weight for linear in group]), x) for group, x in zip(groups, seen)]


def _observer_losses(weight: torch.Tensor, x: torch.Tensor, config) -> list[float]:
    """Each candidate's loss as torchao's AWQObserver.calculate_qparams scores it: the candidate-scaled weight
    quantized by torchao's handler of `config`, its output on x / scale against the float output."""
    from torch.nn import functional as F
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    from torchao.utils import DummyModule

    from quant.awq import AWQ_SCALE_CANDIDATES, candidate_scale

    losses = []
    for index in range(AWQ_SCALE_CANDIDATES):
        scale = candidate_scale(x.abs().mean(0), index)
        quantized = _QUANTIZE_CONFIG_HANDLER[type(config)](DummyModule(weight * scale), config).weight
        losses.append((F.linear(x, weight) - F.linear(x / scale, quantized)).pow(2).mean().item())
    return losses


def _search_losses(weight: torch.Tensor, x: torch.Tensor, quantizer) -> list[float]:
    from quant.awq import AWQ_SCALE_CANDIDATES, candidate_scale

    reference = quantizer.split(weight @ x.T)
    return [quantizer.error([weight], candidate_scale(x.abs().mean(0), index), x, reference).pow(2).mean().item()
            for index in range(AWQ_SCALE_CANDIDATES)]


def _largest_relative_difference(ours: list[float], theirs: list[float]) -> float:
    return max(abs(a - b) / b for a, b in zip(ours, theirs))


def test_the_fast_search_scores_every_candidate_with_torchaos_observer_loss(random_llama):
    """The fast search's loss of each candidate scale, on every token each linear group of a decoder layer reads,
    is the loss torchao's AWQObserver computes with the search config (bf16 group scales, int8 per-token
    activations), to fp32's rounding; a search that left the activations unquantized is told apart."""
    from quant.awq import CandidateQuantizer
    from quant.schemes import search_config

    config = search_config("8da4w")
    for weight, x in _first_layers_inputs(random_llama):
        quantizer = CandidateQuantizer(config)
        theirs = _observer_losses(weight, x, config)
        assert _largest_relative_difference(_search_losses(weight, x, quantizer), theirs) < 1e-5
        quantizer.activations_int8 = False
        assert _largest_relative_difference(_search_losses(weight, x, quantizer), theirs) > 1e-3


def test_the_search_on_every_token_and_candidate_folds_torchaos_scales(random_llama):
    """With every calibration token and every candidate, each linear group scored on its own output, the search
    folds the scales torchao's AWQObserver picks into every norm. The default plan's shortcuts (a token in four,
    a refined coarse grid, gate and up scored on the MLP's output) trade near-ties, whose winner the CPU's
    kernels decide on a model this small: they are judged by the built-in model's fidelity (test_fidelity.py)."""
    from models.llama import ExportOptions, build_exportable
    from quant.awq import EXHAUSTIVE, SearchPlan, apply_awq
    from quant.schemes import search_config

    config, state_dict, _tokens, calibration = random_llama
    every = SearchPlan(token_stride=1, coarse_step=1, mlp_block=False, bf16_products=False)
    folded = []
    for plan in (every, EXHAUSTIVE):
        module = build_exportable(config, state_dict, ExportOptions(64, **FUSED))
        apply_awq(module, search_config("8da4w"), list(calibration), plan)
        folded.append({name: tensor for name, tensor in module.state_dict().items() if name.endswith("norm.weight")})
    norms = [name for name in folded[0] if "layers" in name]
    assert len(norms) == 2 * config.num_hidden_layers
    assert not torch.equal(folded[0][norms[0]], state_dict[norms[0]])  # a scale was folded
    for name in norms:
        assert torch.allclose(folded[0][name], folded[1][name], rtol=1e-6, atol=0), name


def test_the_searchs_quantize_dequantize_is_the_search_configs_own_bit_for_bit():
    """The fast search scores candidates with its own int4 quantize-dequantize on plain tensors: it must be the
    numbers torchao's handler of the search config makes (symmetric min/max groups, scales held in bf16, a zero
    group included), and writing its last multiply to a bf16 tensor must round those same numbers."""
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER
    from torchao.utils import DummyModule

    from quant.awq import CandidateQuantizer
    from quant.schemes import search_config

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=generator) * torch.rand(256, generator=generator) * 0.05
    weight[3, 32:64] = 0
    config = search_config("8da4w")
    expected = _QUANTIZE_CONFIG_HANDLER[type(config)](DummyModule(weight.clone()), config).weight.dequantize()
    quantizer = CandidateQuantizer(config)
    assert quantizer.group == 32 and quantizer.scale_dtype == torch.bfloat16
    assert torch.equal(quantizer.weight(weight.clone()), expected)
    narrow = torch.empty(weight.shape, dtype=torch.bfloat16)
    assert torch.equal(quantizer.weight(weight.clone(), out=narrow, magnitudes=torch.empty_like(weight)),
                       expected.to(torch.bfloat16))


def _pt2e_logits_error(random_llama, algorithm):
    """Relative squared error against fp32 of the qnn-16a4w PT2E simulation (QnnQuantizer's converted q/dq
    module), after the algorithm's float weight transform."""
    from models.llama import build_exportable
    from quant.schemes import prepare_for_scheme, quant_args
    from recipes.lowering.lower import export_program
    from recipes.registry import get_recipe
    from recipes.pipeline.prepare import quantize_exported

    config, state_dict, tokens, calibration = random_llama
    recipe = get_recipe("qnn-16a4w")
    reference = build_exportable(config, state_dict, recipe.export_options(64))
    module = build_exportable(config, state_dict, recipe.export_options(64))
    prepare_for_scheme(module, "16a4w", quant_args("16a4w", None, algorithm, calibration))
    program = export_program(module, 64, strict=recipe.backend.strict_export)
    prompts = [(calibration[0], torch.tensor([0])), (tokens[:, :30], torch.tensor([0]))]
    _, simulated = quantize_exported(recipe, program, prompts, {"quant_algorithm": algorithm}, 64)
    with torch.no_grad():
        reference.reset_cache()
        expected = reference(tokens, torch.tensor([0]))
        got = simulated(tokens, torch.tensor([0]))
    return ((got - expected).pow(2).mean() / expected.pow(2).mean()).item()


@pytest.mark.slow
def test_awq_is_no_worse_than_minmax_under_the_pt2e_16a4w_quantizer(random_llama):
    _assert_no_worse_than_minmax(_pt2e_logits_error(random_llama, "awq"), _pt2e_logits_error(random_llama, "minmax"))


def test_hqq_fits_a_block_of_rows_at_a_time_with_the_result_of_one_whole_fit(monkeypatch):
    """quantize_linears_8da4w calls torchao's HQQ fit once per block of rows (quant.hqq.hqq_by_cache_sized_rows);
    the integers and scales it makes are those of one call on the whole matrix."""
    from torch import nn
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    import quant.hqq as hqq
    from quant.schemes import quantize_linears_8da4w

    torch.manual_seed(0)
    weight = torch.randn(1000, 256) * torch.rand(1000, 1)  # rows of different ranges
    whole = intx._choose_qparams_and_quantize_scale_only_hqq
    rows_per_call = []

    def counting(hp_tensor, *args, **kwargs):
        rows_per_call.append(hp_tensor.shape[0])
        return whole(hp_tensor, *args, **kwargs)

    monkeypatch.setattr(intx, "_choose_qparams_and_quantize_scale_only_hqq", counting)
    monkeypatch.setattr(hqq, "HQQ_BLOCK_ELEMENTS", 300 * 256)
    module = nn.Sequential(nn.Linear(256, 1000, bias=False))
    module[0].weight.data.copy_(weight)
    quantize_linears_8da4w(module, 32, "hqq")

    assert rows_per_call == [300, 300, 300, 100]
    assert intx._choose_qparams_and_quantize_scale_only_hqq is counting  # put back after the block
    from torchao.quantization.quant_primitives import quantize_affine

    from quant.schemes import SCALE_DTYPE_8DA4W

    _, whole_scale = whole(weight, [1, 32], -8, 7)
    expected_scale = whole_scale.to(SCALE_DTYPE_8DA4W)  # then the integers are rounded against the held scales
    expected_qdata = quantize_affine(weight, (1, 32), expected_scale.reshape(1000, -1),
                                     torch.zeros(1000, 8, dtype=torch.int8), torch.int8, -8, 7)
    quantized = module[0].weight
    assert torch.equal(quantized.scale.reshape(expected_scale.shape), expected_scale)
    assert torch.equal(quantized.qdata, expected_qdata)


def test_pt2e_scheme_refuses_hqq_and_spinquant_with_why():
    from quant.quantize import check_options

    with pytest.raises(UserFacingError, match="PT2E quantizer sets 16a4w's qparams from its observers.*awq, minmax"):
        check_options("16a4w", {"quant_algorithm": "hqq"})
    with pytest.raises(UserFacingError, match="larger error than minmax under 16a4w's PT2E quantizer"):
        check_options("16a4w", {"quant_algorithm": "spinquant"})


@pytest.mark.parametrize("algorithm", ["awq", "spinquant"])
def test_weight_transforms_keep_the_fp32_function_and_the_checkpoint(random_llama, algorithm):
    """AWQ's folded scales and SpinQuant's rotations are exact in fp32, and leave the loaded weights alone."""
    from models.llama import ExportOptions, build_exportable
    from quant.algorithms import ALGORITHMS, prepare_weights
    from quant.schemes import config_8da4w

    config, state_dict, tokens, calibration = random_llama
    before = {k: v.clone() for k, v in state_dict.items()}
    reference = build_exportable(config, state_dict, ExportOptions(64, **FUSED))
    module = build_exportable(config, state_dict, ExportOptions(64, **FUSED))
    prepare_weights(module, algorithm, config_8da4w(32, ALGORITHMS[algorithm].qparams), calibration)
    with torch.no_grad():
        expected = reference(tokens, torch.tensor([0]))
        assert torch.allclose(module(tokens, torch.tensor([0])), expected, atol=1e-4)
    assert all(torch.equal(state_dict[k], before[k]) for k in before)


def _program_form(program) -> tuple[list, list]:
    """What an ExportedProgram computes with, without the values: (each node's op and its output's shape and
    dtype, in order; each constant's type, shape and dtype)."""
    nodes = []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        nodes.append((node.op, str(node.target) if node.op != "placeholder" else None,
                      (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else None))
    constants = {**program.state_dict, **program.constants}
    return nodes, sorted((name, type(t).__name__, tuple(t.shape), t.dtype) for name, t in constants.items()
                         if isinstance(t, torch.Tensor))


def test_algorithms_keep_the_program_format(tiny_checkpoint):
    """Every algorithm exports the same program as minmax (the same ops on constants of the same shapes and
    dtypes, only their values differ), so it lowers to the same XNNPACK program: minmax's is lowered and run."""
    from models.llama import build_exportable
    from quant.calibration import calibration_windows
    from quant.schemes import apply_scheme
    from recipes.running.generate import load_runtime_method, runtime_step
    from recipes.lowering.lower import export_program, lower_for_backend
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-8da4w")
    backend = recipe.backend
    windows = calibration_windows(tiny_checkpoint.tokenizer, 32)
    forms = {}
    for algorithm in ("minmax", "hqq", "awq", "spinquant", "gptq"):
        module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, recipe.export_options(32))
        apply_scheme(module, "8da4w", 32, algorithm, windows)
        program = export_program(module, 32, strict=backend.strict_export)
        forms[algorithm] = _program_form(program)
        if algorithm == "minmax":
            lowered = lower_for_backend(program, recipe, {})
            step = runtime_step(load_runtime_method(lowered.pte, backend.runtime_imports))
            tokens = torch.tensor([[3, 5, 7, 4]])
            with torch.no_grad():
                eager = module(tokens, torch.tensor([0]))
            assert torch.allclose(step(tokens, torch.tensor([0])), eager, atol=5e-2)  # XNNPACK rounds activations its own way
            assert lowered.delegation.delegated_nodes > 0
    nodes, _constants = forms["minmax"]
    assert sum(value is not None and value[1] == torch.int8 for _op, _target, value in nodes) > 10  # int4 weights inside
    for algorithm, form in forms.items():
        assert form == forms["minmax"], algorithm


def test_unavailable_algorithm_is_refused_with_the_reason():
    from quant.quantize import check_options

    with pytest.raises(UserFacingError, match="spinquant-r4.*online Hadamard.*choose one of: awq, hqq, minmax, spinquant, "
                                              "gptq, awq-gptq"):
        check_options("8da4w", {"quant_algorithm": "spinquant-r4"})
    with pytest.raises(UserFacingError, match=r"gptq' is not offered for 16a4w \(.*GPTQ chooses the integers itself"):
        check_options("16a4w", {"quant_algorithm": "gptq"})
    with pytest.raises(UserFacingError, match=r"8da8w has no int4 group-wise weights\); choose one of: minmax\."):
        check_options("8da8w", {"quant_algorithm": "hqq"})
    with pytest.raises(UserFacingError, match=r"outside \(0, 1\]"):
        check_options("8da4w", {"mixed_precision_budget": 3})


def _windows_of_tokens(ids: list[int], size: int = 32) -> set[tuple[int, ...]]:
    return {tuple(ids[i:i + size]) for i in range(len(ids) - size + 1)}


def test_calibration_and_evaluation_texts_share_no_32_token_window():
    from quant.calibration import CALIBRATION_TEXT
    from recipes.evaluation.fidelity import EVAL_TEXT, HELDOUT_TEXT

    paths = [CALIBRATION_TEXT, EVAL_TEXT, HELDOUT_TEXT]
    assert len({p.resolve() for p in paths}) == 3 and all(p.exists() for p in paths)
    try:
        from models.sources.checkpoint import builtin_gguf_path
        from transformers import AutoTokenizer

        gguf = builtin_gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    except Exception:  # without the built-in model: words and punctuation marks as tokens
        vocabulary: dict[str, int] = {}
        tokenize = lambda text: [vocabulary.setdefault(w, len(vocabulary))  # noqa: E731
                                 for w in re.findall(r"\w+|[^\w\s]", text)]
    windows = [_windows_of_tokens(tokenize(p.read_text())) for p in paths]
    assert all(len(w) > 100 for w in windows)
    assert not windows[0] & windows[1] and not windows[0] & windows[2] and not windows[1] & windows[2]
    # the check itself finds a shared passage
    assert _windows_of_tokens(list(range(50))) & _windows_of_tokens(list(range(10, 80)))


@pytest.mark.slow
def test_gptq_reads_its_own_calibration_tokens_and_the_searches_the_default(tiny_checkpoint):
    """GPTQ's Hessians need many more tokens than they are wide; AWQ's search and the mixed-precision search,
    which run the model once per candidate, keep to the default count. The report says which read what."""
    from models.llama import build_exportable
    from quant.calibration import CALIBRATION_TOKENS
    from quant.awq import native_bf16_products
    from quant.gptq import GPTQ_CALIBRATION_TOKENS
    from quant.quantize import quantize_module
    from recipes.registry import get_recipe

    def quantize(options):
        module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict,
                                  get_recipe("xnnpack-8da4w").export_options(64))
        return quantize_module(module, "8da4w", options, tiny_checkpoint.tokenizer, 64)

    alone, _ = quantize({"quant_algorithm": "gptq"})
    assert alone["calibration"]["tokens"] == GPTQ_CALIBRATION_TOKENS and "search_tokens" not in alone["calibration"]
    assert "search_products" not in alone["calibration"]  # GPTQ searches no scales
    section, seconds = quantize({"quant_algorithm": "awq-gptq", "mixed_precision_budget": 0.3})
    assert section["calibration"]["tokens"] == GPTQ_CALIBRATION_TOKENS > 4 * CALIBRATION_TOKENS
    assert section["calibration"]["search_tokens"] == CALIBRATION_TOKENS
    # AWQ's candidates were multiplied in bf16 where the CPU has its instructions
    assert section["calibration"]["search_products"] == ("bf16" if native_bf16_products() else "fp32")
    assert "Alice" in section["calibration"]["text"]
    assert section["mixed_precision"]["measured_on_tokens"] == CALIBRATION_TOKENS
    assert seconds["quant_algorithm"] > 0 and seconds["mixed_precision_search"] > 0


def test_awq_quantized_piece_by_piece_as_it_is_built_is_the_whole_float_modules_awq(tiny_checkpoint):
    """AWQ searches each decoder layer from the hidden states entering it, so the module built and quantized one
    piece at a time (one float piece held at once) is exactly the one AWQ quantizes whole."""
    from models.llama import build_exportable
    from quant.quantize import UnitQuantizer, quantize_module, quantizes_by_unit
    from recipes.registry import get_recipe

    options = {"quant_algorithm": "awq"}
    assert quantizes_by_unit("8da4w", options)
    export_options = get_recipe("xnnpack-8da4w").export_options(64)
    quantizer = UnitQuantizer("8da4w", options, tiny_checkpoint.tokenizer, 64)
    # in the job's order: the output layer right after the embedding (recipes/pipeline/prepare.py)
    by_unit = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, export_options,
                               transform_unit=quantizer, output_first=True)
    whole = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, export_options)
    section, seconds = quantize_module(whole, "8da4w", options, tiny_checkpoint.tokenizer, 64)
    assert quantizer.section(by_unit) == section and "Alice" in section["calibration"]["text"]
    assert quantizer.seconds["quant_algorithm"] > 0 and seconds["quant_algorithm"] > 0

    def values(tensor):
        return tensor.dequantize() if hasattr(tensor, "dequantize") else tensor

    by_unit_state, whole_state = by_unit.state_dict(), whole.state_dict()
    assert list(by_unit_state) == list(whole_state)
    for name, tensor in by_unit_state.items():
        assert torch.equal(values(tensor), values(whole_state[name])), name
    # AWQ's scales were folded: the norms before the linears are no longer the checkpoint's
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(by_unit_state[norm], tiny_checkpoint.state_dict[norm].to(torch.float32))


@pytest.mark.slow
def test_mixed_precision_measures_every_unit_and_keeps_the_best_per_byte_within_the_budget(random_llama):
    from models.llama import ExportOptions, build_exportable
    from quant.mixed_precision import choose_8bit_units, linear_weight_bytes
    from quant.schemes import apply_scheme

    config, state_dict, tokens, calibration = random_llama
    build = lambda: build_exportable(config, state_dict, ExportOptions(64, **FUSED))  # noqa: E731
    quantize = lambda m, units: apply_scheme(m, "8da4w", 32, "hqq", units_8bit=units)  # noqa: E731
    module = build()
    choice = choose_8bit_units(module, quantize, list(calibration), 0.3)
    gain, cost, base = choice["unit_kl_gain"], choice["unit_cost_bytes"], choice["int4_bytes_per_token"]
    # every linear is a unit of its own, the output layer last
    linears = [name for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(gain) == sorted(linears) and len(linears) > 3 and list(gain)[-1] == "lm_head"
    # one linear alone at 8 bits can also move the logits away by chance: only a gain is ever kept
    assert max(gain.values()) > 0 and all(c > 0 for c in cost.values())

    def mean_kl(units):
        reference, mixed = build(), build()
        quantize(mixed, units)
        with torch.no_grad():
            ref = torch.log_softmax(reference(calibration[0], torch.tensor([0]))[0], -1)
            out = torch.log_softmax(mixed(calibration[0], torch.tensor([0]))[0], -1)
        return (ref.exp() * (ref - out)).sum(-1).mean().item(), linear_weight_bytes(mixed)

    # Each unit's gain and cost are those of the model quantized with that unit alone at 8da8w.
    int4_kl, int4_bytes = mean_kl(())
    assert int4_bytes == base and abs(int4_kl - choice["int4_mean_kl"]) < 1e-4
    for unit in gain:
        kl, size = mean_kl((unit,))
        assert abs(int4_kl - kl - gain[unit]) < 1e-4 and size - base == cost[unit], unit
    # What is kept fits and is the best per byte; whatever is left would not fit beside it.
    kept = choice["units_8bit"]
    assert kept and choice["extra_bytes_per_token"] == sum(cost[u] for u in kept) <= 0.3 * base
    best = max(gain, key=lambda u: gain[u] / cost[u])
    assert best in kept
    assert all(choice["extra_bytes_per_token"] + cost[u] > 0.3 * base for u in gain if u not in kept)
    assert mean_kl(tuple(kept))[0] < int4_kl
    everything = sum(cost.values()) / base  # a budget every unit fits in
    # every unit that gains is kept (the report rounds gains: a kept one may show 0.0, never less)
    kept_all = choose_8bit_units(module, quantize, list(calibration), everything)["units_8bit"]
    assert {u for u in gain if gain[u] > 0} <= set(kept_all) and all(gain[u] >= 0 for u in kept_all)
    assert choose_8bit_units(module, quantize, list(calibration), min(cost.values()) / base / 2)["units_8bit"] == []


def test_pt2e_quantization_lets_the_float_weights_go_and_keeps_only_the_integer_ones(tiny_checkpoint):
    """The converted module and the program exported from it hold each quantized weight once, as integers;
    the float module and its program are freed when the caller drops them (no cache keeps them)."""
    import gc
    import weakref

    from models.llama import build_exportable
    from quant.calibration import calibration_inputs
    from recipes.lowering.lower import export_program
    from recipes.registry import get_recipe
    from recipes.pipeline.prepare import quantize_exported

    recipe = get_recipe("qnn-16a4w")
    config, state_dict = tiny_checkpoint.config, tiny_checkpoint.state_dict
    module = build_exportable(config, state_dict, recipe.export_options(64))
    linears = {name: weakref.ref(m.weight) for name, m in module.named_modules()
               if isinstance(m, torch.nn.Linear)}
    program = export_program(module, 64, strict=recipe.backend.strict_export)
    quantized, converted = quantize_exported(recipe, program, calibration_inputs(tiny_checkpoint.tokenizer, 64)[:1],
                                             {"quant_algorithm": "minmax"}, 64)
    del module, program
    gc.collect()
    assert [name for name, weight in linears.items() if weight() is not None] == []
    for held in (dict(converted.state_dict()), {**quantized.state_dict, **quantized.constants}):
        linear_shaped = [name for name, t in held.items()
                         if t.dtype.is_floating_point and t.dim() == 2 and t.shape[1] == config.hidden_size
                         and "embed" not in name]
        assert linear_shaped == [], f"float copies of quantized weights are still held: {linear_shaped[:3]}"


def test_gptq_on_uncorrelated_inputs_rounds_each_weight_to_its_group_grid():
    """With an identity Hessian no column's error can be compensated by another: GPTQ is rounding to nearest."""
    from quant.gptq import QMAX, QMIN, gptq_weight

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    values, scales = gptq_weight(weight, torch.eye(64), 32, damping=0.0)
    rounded = (weight.view(16, 2, 32) / scales[..., None]).round().clamp(QMIN, QMAX).view(16, 64)
    assert torch.equal(values.float(), rounded)
    assert torch.equal(scales, scales.to(torch.bfloat16).float())  # as a .pte stores them


def test_gptq_scale_refit_solves_each_rows_least_squares_and_never_adds_error():
    """The refit scales are the least-squares scales for GPTQ's integers against the Hessian (a direct
    solve of the same problem agrees), they are bf16, and no row's error grows."""
    from quant.gptq import _damped, _row_errors, gptq_weight, refit_scales

    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(400, 64, generator=generator) @ torch.randn(64, 64, generator=generator)
    hessian = 2 * inputs.T @ inputs
    weight = torch.randn(8, 64, generator=generator)
    values, scales = gptq_weight(weight, hessian, 32)
    refitted = refit_scales(weight, hessian, values, scales, 32)
    damped = _damped(hessian, 0.1)
    before = _row_errors(weight, damped, values, scales, 32)
    after = _row_errors(weight, damped, values, refitted, 32)
    assert torch.all(after <= before) and after.sum() < 0.99 * before.sum()
    assert torch.equal(refitted, refitted.to(torch.bfloat16).float())
    for row in range(8):  # least squares over the row's two scales, written out as a design matrix
        design = torch.zeros(64, 2)
        design[:32, 0], design[32:, 1] = values[row, :32].float(), values[row, 32:].float()
        root = torch.linalg.cholesky(damped.double()).T  # w H wᵀ = ||root w||²
        exact = torch.linalg.lstsq(root @ design.double(), root @ weight[row].double()).solution
        assert torch.allclose(refitted[row].double(), exact, rtol=1e-2)


def test_gptq_hessian_of_a_shared_input_is_torchaos_observer_hessian():
    """One Hessian per input, summed by its upper triangle's block rows: torchao's GPTQ observer's, to fp32's rounding."""
    from torchao.prototype.gptq.observer import GPTQObserverTensor

    from quant import gptq

    generator = torch.Generator().manual_seed(6)
    calls = [torch.randn(1, 40, 96, generator=generator) * torch.linspace(0.1, 3, 96) for _ in range(3)]
    observer = GPTQObserverTensor.from_hp(torch.zeros(8, 96))
    ours = gptq._Hessian(96)
    original_block, gptq.HESSIAN_BLOCK = gptq.HESSIAN_BLOCK, 32  # several block rows, one of them partial
    try:
        for x in calls:
            torch.nn.functional.linear(x, observer)
            ours.add(x)
    finally:
        gptq.HESSIAN_BLOCK = original_block
    assert torch.allclose(ours.value(), observer.hessian, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("attention", ["custom", "sdpa"])
def test_gptq_quantizes_a_layer_in_call_order_and_hands_on_the_quantized_layers_outputs(random_llama, attention):
    """Linears reading one input share a Hessian (q/k/v or the fused qkv, gate/up); the outputs quantize_layer
    returns, made in the same passes, are the quantized layer's own on each window."""
    from models.llama import ExportOptions, build_exportable
    from quant.gptq import _first_layer_inputs, _input_groups, quantize_layer
    from quant.schemes import SCALE_DTYPE_8DA4W, int4_weight_with_scales

    config, state_dict, _, _ = random_llama
    module = build_exportable(config, state_dict, ExportOptions(64, **_module_form(attention)))
    layer, attn, mlp = module.model.layers[0], module.model.layers[0].self_attn, module.model.layers[0].mlp
    windows = list(_calibration(random_llama, "gptq"))[:4]
    inputs = _first_layer_inputs(module, windows)
    hidden, arguments = [a[0] for a in inputs], [a[1:] for a in inputs]
    qkv = [attn.qkv_proj] if attention == "custom" else [attn.q_proj, attn.k_proj, attn.v_proj]
    assert _input_groups(layer, hidden[0], arguments[0]) == [qkv, [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                                                              [mlp.down_proj]]
    outputs = quantize_layer(layer, hidden, arguments, 32, int4_weight_with_scales("int8_asym_per_token",
                                                                                   SCALE_DTYPE_8DA4W))
    assert all(type(m.weight) is not torch.Tensor for m in (*qkv, attn.o_proj, mlp.gate_proj, mlp.down_proj))
    assert "forward" not in vars(attn.o_proj)  # the replaying forward is gone
    with torch.no_grad():
        for x, args, out in zip(hidden, arguments, outputs):
            module.reset_cache()
            assert torch.equal(layer(x, *args), out)
