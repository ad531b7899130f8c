"""The Neural Engine recipes' program against ExecuTorch's own static Llama export
(examples/apple/coreml/llama/export_static_llm_coreml.py in the wheel, run on the same tiny Llama): the same
methods, input and output specs and constant methods, but for the differences listed here and justified in
docs/coreml.md."""
import json
import sys
from pathlib import Path

import pytest
import torch

CONTEXT, CHUNK = 32, 4

# Every way Lowerbench's program may differ from ExecuTorch's, as contract_differences names it; docs/coreml.md
# justifies each. Lowerbench's extra constant methods are ExecuTorch's LLM runners' metadata.
ALLOWED_DIFFERENCES = {
    ("only in Lowerbench's", name) for name in (
        "get_max_seq_len", "get_max_context_len", "get_vocab_size", "get_n_layers", "use_kv_cache",
        "use_sdpa_with_kv_cache", "enable_dynamic_shape", "get_bos_id", "get_eos_ids")
}

# Hugging Face's Llama weights under the names of ExecuTorch's Llama (examples/models/llama).
_META_NAMES = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
               "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
               "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2", "mlp.up_proj": "feed_forward.w3",
               "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def _meta_checkpoint(checkpoint, folder: Path) -> tuple[Path, Path]:
    """(checkpoint.pth, params.json) of the tiny Llama for ExecuTorch's script. The q/k weights keep Hugging Face's
    rope layout: the programs' specs and constants do not depend on it."""
    state = {}
    for name, value in checkpoint.state_dict.items():
        tensor = torch.as_tensor(value).clone()
        if name == "model.embed_tokens.weight":
            state["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            state["output.weight"] = tensor
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, leaf = rest.rpartition(".")
            state[f"layers.{layer}.{_META_NAMES[module]}.{leaf}"] = tensor
    state.setdefault("output.weight", state["tok_embeddings.weight"])
    config = checkpoint.config
    params = {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
              "n_kv_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
              "hidden_dim": config.intermediate_size, "norm_eps": config.rms_norm_eps,
              "rope_theta": config.rope_parameters["rope_theta"]}
    torch.save(state, folder / "checkpoint.pth")
    (folder / "params.json").write_text(json.dumps(params))
    return folder / "checkpoint.pth", folder / "params.json"


@pytest.fixture(scope="module")
def executorch_static_pte(tiny_checkpoint, tmp_path_factory, monkeypatch_module):
    """ExecuTorch's own script, its main() as its README runs it (--multifunction: `forward` and `prefill` sharing
    their weights), on the tiny Llama."""
    from executorch.examples.apple.coreml.llama import export_static_llm_coreml

    folder = tmp_path_factory.mktemp("executorch-static")
    checkpoint, params = _meta_checkpoint(tiny_checkpoint, folder)
    monkeypatch_module.setattr(sys, "argv", [
        "export_static_llm_coreml.py", "--checkpoint", str(checkpoint), "--params", str(params),
        "--output", str(folder / "model.pte"), "--max_context_len", str(CONTEXT), "--input_len", str(CHUNK),
        "--multifunction"])
    export_static_llm_coreml.main()
    return folder / "model.pte"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def lowerbench_static_pte(tiny_llama_dir, tmp_path_factory):
    """coreml-ane-c4w (ExecuTorch's script's default quantization: int4 per channel, 8-bit embeddings) on the tiny
    Llama through run(), export only."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("lowerbench-static")
    summary = run(RunRequest(recipes=["coreml-ane-c4w"], out_dir=out, model=str(tiny_llama_dir), max_seq_len=CONTEXT,
                             max_new_tokens=4, generate=False,
                             options={"prefill_chunk": CHUNK, "quant_algorithm": "minmax"}))
    assert not summary.recipes[0].errors, summary.recipes[0].errors
    return out / "model.pte"


def program_contract(pte: Path) -> dict:
    """{method: ("method", inputs, outputs) or ("constant", value)}, read by the ExecuTorch runtime: each input and
    output as (dtype, sizes, memory-planned); the constant methods run (they run anywhere, Core ML or not)."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte))
    contract = {}
    for name in sorted(program.method_names):
        meta = program.metadata(name)
        if meta.num_inputs():
            specs = [[(str(t.dtype()), list(t.sizes()), t.is_memory_planned()) for t in tensors]
                     for tensors in ([meta.input_tensor_meta(i) for i in range(meta.num_inputs())],
                                     [meta.output_tensor_meta(i) for i in range(meta.num_outputs())])]
            contract[name] = ("method", *specs)
        else:
            contract[name] = ("constant", program.load_method(name).execute([]))
    return contract


def _same_constant(ours: list, theirs: list) -> bool:
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if a != b:
                return False
        elif a.dtype != b.dtype or a.shape != b.shape:
            return False
        elif a.is_floating_point():
            # the rope tables: both cos/sin of the same angles in fp32, then fp16; rounding apart at most
            if not torch.allclose(a.float(), b.float(), rtol=0, atol=1e-3):
                return False
        elif not torch.equal(a, b):
            return False
    return True


def contract_differences(ours: dict, theirs: dict) -> set[tuple[str, ...]]:
    differences = {("only in Lowerbench's", name) for name in ours.keys() - theirs.keys()}
    differences |= {("only in ExecuTorch's", name) for name in theirs.keys() - ours.keys()}
    for name in ours.keys() & theirs.keys():
        (kind, *ours_value), (their_kind, *theirs_value) = ours[name], theirs[name]
        if kind != their_kind:
            differences.add(("kind", name))
        elif kind == "method":
            for side, a, b in zip(("inputs", "outputs"), ours_value, theirs_value):
                if a != b:
                    differences.add((side, name, repr(a), repr(b)))
        elif not _same_constant(ours_value[0], theirs_value[0]):
            differences.add(("value", name, repr(ours_value[0]), repr(theirs_value[0])))
    return differences


def test_neural_engine_program_has_executorch_static_exports_methods_specs_and_metadata(lowerbench_static_pte,
                                                                                        executorch_static_pte):
    """A runner written against ExecuTorch's static programs (its C++ StaticAttentionIOManager) finds in
    Lowerbench's program what it finds in ExecuTorch's: the methods, each input's and output's dtype, shape and
    memory planning, and the constant methods' values; the differences are exactly the table's, each justified in
    docs/coreml.md."""
    ours, theirs = program_contract(lowerbench_static_pte), program_contract(executorch_static_pte)
    assert {"forward", "prefill", "prefill_kv_cache_specs", "freqs_cos"} <= theirs.keys()
    assert contract_differences(ours, theirs) == ALLOWED_DIFFERENCES
    doc = (Path(__file__).resolve().parent.parent / "docs" / "coreml.md").read_text()
    assert all(f"`{name}`" in doc for _, name in ALLOWED_DIFFERENCES)


def test_contract_comparison_finds_a_changed_spec_and_a_changed_value(executorch_static_pte):
    """The comparison is not blind: a cache one row longer, or a kv cache spec pointing at another output, is a
    difference the table does not allow."""
    theirs = program_contract(executorch_static_pte)
    longer = dict(theirs)
    kind, inputs, outputs = theirs["forward"]
    longer["forward"] = (kind, [(d, s[:2] + [s[2] + 1] + s[3:] if len(s) == 4 else s, p) for d, s, p in inputs],
                         outputs)
    assert {d[:2] for d in contract_differences(longer, theirs)} == {("inputs", "forward")}
    specs = theirs["decode_kv_cache_specs"][1][0].clone()
    specs[0, 1] += 1
    moved = {**theirs, "decode_kv_cache_specs": ("constant", [specs])}
    assert {d[:2] for d in contract_differences(moved, theirs)} == {("value", "decode_kv_cache_specs")}
