"""QNN's hybrid program (prefill_tokens): a prefill_forward method of N tokens per call and a one-token kv_forward,
one quantization and one weight set for both, in the interface Qualcomm's qnn_llama_runner reads. A one-layer Llama
as wide as real ones in its linears (so that its weights, not its graph, make most of a .pte) is quantized once and
lowered once for the module (QNN compiles are slow)."""
import dataclasses
import sys
import types

import pytest
import torch

from tests.test_qnn import needs_qnn

CONTEXT, PREFILL = 32, 8


@pytest.fixture(scope="module")
def hybrid(wide_llama_dir):
    """(checkpoint, recipe, options, {method: tokens}, {method: quantized program}, the simulation of them)."""
    from models.llama import build_exportable
    from models.sources.checkpoint import load_checkpoint
    from quant.calibration import calibration_inputs
    from recipes.lowering import kv_io_program
    from recipes.pipeline.prepare import quantize_exported
    from recipes.registry import get_recipe

    checkpoint = load_checkpoint(str(wide_llama_dir))
    recipe = get_recipe("qnn-16a4w")
    options = {**recipe.options, "prefill_tokens": PREFILL}
    methods = recipe.backend.kv_io_methods(options, CONTEXT)
    module = build_exportable(checkpoint.config, checkpoint.state_dict, recipe.export_options(CONTEXT))
    programs = kv_io_program.export_methods(kv_io_program.kv_io_form(module), methods, strict=False)
    programs, simulation = quantize_exported(recipe, programs, calibration_inputs(checkpoint.tokenizer, CONTEXT)[:4],
                                             options, CONTEXT, module=module)
    return checkpoint, recipe, options, methods, programs, simulation


@pytest.fixture(scope="module")
def hybrid_pte(hybrid, tmp_path_factory):
    """The hybrid .pte and, for its size, the same quantized kv_forward lowered alone: (hybrid, decode-only)."""
    from models.prompting import stop_token_ids
    from recipes.lowering import kv_io_program
    from recipes.lowering.lower import Lowering, lower_for_backend

    checkpoint, recipe, options, methods, programs, simulation = hybrid
    metadata = kv_io_program.kv_io_metadata(simulation, methods, checkpoint.config, checkpoint.tokenizer,
                                            stop_token_ids(checkpoint.tokenizer, checkpoint.eos_token_ids))
    folder = tmp_path_factory.mktemp("qnn-hybrid")
    lowered = {}
    for name, program in (("hybrid", programs), ("decode-only", {"kv_forward": programs["kv_forward"]})):
        lowered[name] = lower_for_backend(program, recipe, options, Lowering(
            constant_methods=metadata, pte_path=folder / f"{name}.pte", caller_allocates_io=True))
    return lowered["hybrid"], lowered["decode-only"]


def test_prefill_by_n_then_decode_matches_one_token_calls_and_the_programs_to_lower(hybrid):
    """The simulation prefills by N (the last call padded) and then decodes, as the runner does; its logits are
    those of token-by-token kv_forward calls, and those of the quantized programs that are lowered."""
    _checkpoint, _recipe, _options, _methods, programs, simulation = hybrid
    tokens = [3, 5, 7, 2, 9, 4, 8, 6, 10, 11, 12, 3, 5]  # one whole prefill call, one padded, then decode
    with torch.no_grad():
        session = simulation.session
        session.reset()
        hybrid_logits = torch.cat([session.prefill(tokens[:11]), torch.stack([session.decode(t) for t in tokens[11:]])])
        session.reset()
        one_token = torch.stack([session.decode(t) for t in tokens])
        modules = {name: program.module() for name, program in programs.items()}
        lowered = dataclasses.replace(session, call=lambda method, inputs: list(modules[method](*inputs)))
        lowered.reset()
        lowered_logits = torch.cat([lowered.prefill(tokens[:11]), torch.stack([lowered.decode(t) for t in tokens[11:]])])
        through_module = simulation(torch.tensor([tokens[:11]]), torch.tensor([0]))[0]
    spread = one_token.abs().max().item()
    assert (hybrid_logits - one_token).abs().max().item() < 0.02 * spread
    assert torch.equal(hybrid_logits.argmax(-1), one_token.argmax(-1))
    assert (hybrid_logits - lowered_logits).abs().max().item() < 1e-4
    assert torch.allclose(through_module, hybrid_logits[:11], atol=1e-5)


@needs_qnn
def test_the_hybrid_pte_holds_both_methods_with_the_weights_stored_once(hybrid, hybrid_pte):
    """Both methods compile into one QNN context with HTP weight sharing: the .pte holds prefill_forward and
    kv_forward, each a whole QNN partition, and the second method adds its graph, not a second copy of the
    weights. (At this size a graph is still a good part of a .pte; on the built-in model the hybrid .pte is within
    1.1x of kv_forward alone, docs/qnn.md.)"""
    from recipes.files.pte_program import method_interfaces, read_program

    both, decode_only = hybrid_pte
    interfaces = method_interfaces(both.pte_path)
    assert {"prefill_forward", "kv_forward"} <= set(interfaces)
    program = read_program(both.pte_path)
    plans = {plan.name: plan for plan in program.execution_plan}
    assert [d.id for d in plans["prefill_forward"].delegates] == ["QnnBackend"]
    assert [d.id for d in plans["kv_forward"].delegates] == ["QnnBackend"]
    assert both.delegation.delegated_subgraphs == 2
    assert all(op.non_delegated == 0 for op in both.delegation.ops if op.op.startswith("aten_convolution"))
    weights = _quantized_weight_bytes(hybrid[4]["kv_forward"])
    assert both.pte_bytes - decode_only.pte_bytes < 0.5 * weights, (both.pte_bytes, decode_only.pte_bytes, weights)


def _quantized_weight_bytes(program) -> int:
    """At least the bytes of the program's weights as QNN stores them: its integer tensors, counted at 4 bits."""
    tensors = [*program.state_dict.values(), *program.constants.values()]
    return sum(t.numel() // 2 for t in tensors
               if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point())


def _qualcomm_static_llama():
    """The wheel's examples/qualcomm/oss_scripts/llama/model/static_llama.py, the model Qualcomm's llama.py
    compiles, imported without its package's __init__ (which needs torchtune, not in this stack)."""
    import importlib

    import executorch.examples.qualcomm.oss_scripts as oss

    name = "executorch.examples.qualcomm.oss_scripts.llama"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [f"{oss.__path__[0]}/llama"]
        sys.modules[name] = package
    return importlib.import_module(f"{name}.model.static_llama")


def _qualcomm_interface(config, ar_len: int, context: int) -> dict:
    """What Qualcomm's LlamaModel of this shape takes and returns for AR-N = ar_len (its get_example_inputs and
    forward), in method_interfaces' form, and its get_metadata."""
    static_llama = _qualcomm_static_llama()
    args = static_llama.ModelArgs(dim=config.hidden_size, n_layers=config.num_hidden_layers,
                                  n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                                  vocab_size=config.vocab_size, hidden_dim=config.intermediate_size,
                                  max_seq_len=context, max_context_len=context, use_kv_cache=True, max_batch_size=1)
    args.kv_io_bit_width = 32  # its sentinel for float KV inputs and outputs
    model = static_llama.LlamaModel(args, ar_len=ar_len, output_new_cache_only=True, output_cache=True,
                                    use_i64_token=False)
    tokens, masks, positions, k_caches, v_caches = model.get_example_inputs()
    inputs = [tokens, *masks, positions, *k_caches, *v_caches]
    with torch.no_grad():
        logits, k_new, v_new = model(*inputs)

    def spec(t):  # Qualcomm's llama.py plans no memory for inputs and outputs: the runner sets them
        return str(t.dtype).removeprefix("torch."), tuple(t.shape), False

    return {"inputs": [spec(t) for t in inputs], "outputs": [spec(t) for t in [logits, *k_new, *v_new]],
            "metadata": model.get_metadata()}


# Where the hybrid .pte's interface differs from Qualcomm's static Llama of the same shape (docs/qnn.md says why).
EXPECTED_DIFFERENCES: dict = {}


@needs_qnn
def test_the_hybrid_pte_has_the_methods_inputs_outputs_and_metadata_of_qualcomms_program(hybrid, hybrid_pte):
    """Against the model Qualcomm's llama.py compiles (its static_llama.py from the wheel, run at the tiny
    Llama's shape): the same method names, the same inputs and outputs in order, dtype and shape for AR-N and
    AR-1, unplanned I/O, and the same metadata methods and values. llama.py itself does not run here
    (docs/qnn.md)."""
    from recipes.files.pte_program import method_interfaces

    checkpoint, _recipe, _options, methods, _programs, _simulation = hybrid
    both, _decode_only = hybrid_pte
    ours = method_interfaces(both.pte_path)
    differences = {}
    for method, ar_len in methods.items():
        theirs = _qualcomm_interface(checkpoint.config, ar_len, CONTEXT)
        for side in ("inputs", "outputs"):
            if ours[method][side] != theirs[side]:
                differences[f"{method} {side}"] = (ours[method][side], theirs[side])
    metadata = _qualcomm_interface(checkpoint.config, 1, CONTEXT)["metadata"]  # llama.py writes the decode's
    ours_metadata = {name: value["value"] for name, value in ours.items() if "value" in value}
    for name in sorted(set(metadata) | set(ours_metadata)):
        if ours_metadata.get(name) != metadata.get(name):
            differences[name] = (ours_metadata.get(name), metadata.get(name))
    assert differences == EXPECTED_DIFFERENCES
