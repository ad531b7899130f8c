"""Qualcomm QNN: QnnQuantizer PT2E schemes, the no-SDK fast failure inside a side-by-side run, and
(when host QNN libraries are present, e.g. onnxruntime-qnn) a real HTP partition + context binary."""
import json
import os
import time

import pytest
import torch

from models.errors import UserFacingError
from tests.conftest import run_cli


@pytest.fixture
def no_qnn_libraries(monkeypatch, tmp_path):
    """A process that sees no QNN host libraries anywhere (the installed onnxruntime-qnn hidden)."""
    import recipes.backends.qnn

    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.setenv("QNN_STAGING_DIR", str(tmp_path / "executorch-qnn-cache"))
    monkeypatch.setattr(recipes.backends.qnn, "onnxruntime_qnn_dir", lambda: None)


def test_16a4w_quantization_makes_q_dq_graph_and_simulated_generation_runs(tiny_qnn_16a4w):
    from recipes.running import generate as gen

    checkpoint, program, _simulated = tiny_qnn_16a4w
    nodes = [n for n in program.graph.nodes if n.op == "call_function"]
    # (QNN's to_edge passes then turn each linear into a 1x1 conv2d: test_block_quantized_linears_wider_...)
    linears = [n for n in nodes if n.target == torch.ops.aten.linear.default]
    assert len(linears) == 2 * 7 + 1
    # layer weights 4-bit in blocks of 32 input channels, the output layer 8-bit per channel;
    # every activation 16-bit
    for linear in linears[:-1]:
        weight = linear.args[1]
        assert weight.target == torch.ops.torchao.dequantize_affine.default
        assert list(weight.args[1]) == [1, 32] and tuple(weight.args[5:7]) == (-7, 7)  # symmetric int4 blocks
    head = linears[-1].args[1]
    assert head.target == torch.ops.quantized_decomposed.dequantize_per_channel.default
    assert tuple(head.args[4:6]) == (-127, 127)
    act_q = [n for n in nodes if n.target == torch.ops.quantized_decomposed.quantize_per_tensor.default]
    assert act_q and all(n.args[4] - n.args[3] >= 65534 for n in act_q)  # 16-bit (uint16 or symmetric int16)
    # a static one-token program: prefill runs token by token through the same q/dq graph
    tokens = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name == "tokens")
    assert tuple(tokens.meta["val"].shape) == (1, 1)
    result = gen.generate(gen.eager_step(program.module()), "eager-qnn-simulated", checkpoint.tokenizer,
                          "what is the capital ?", 4, 32)
    assert result.engine == "eager-qnn-simulated" and result.new_tokens >= 1


def test_simulation_module_is_the_lowered_quantization_and_takes_a_whole_prefill(tiny_qnn_16a4w):
    """Fed token by token, the simulation module computes what the one-token program to lower computes;
    it also takes a whole prefill in one call (so fidelity and prompts need not go token by token)."""
    checkpoint, program, simulated = tiny_qnn_16a4w
    tokens = torch.tensor([[3, 5, 7, 2, 9]])
    with torch.no_grad():
        one_token = program.module()
        lowered_steps = torch.cat([one_token(tokens[:, i:i + 1], torch.tensor([i])) for i in range(5)], dim=1)
        simulated_steps = torch.cat([simulated(tokens[:, i:i + 1], torch.tensor([i])) for i in range(5)], dim=1)
        whole = simulated(tokens, torch.tensor([0]))
    assert (simulated_steps - lowered_steps).abs().max().item() < 1e-4
    assert whole.shape == (1, 5, checkpoint.config.vocab_size)
    assert torch.allclose(whole[:, 0], lowered_steps[:, 0], atol=1e-4)  # the first position sees no cache


def test_one_token_calls_after_a_prefill_match_the_whole_call(tiny_qnn_16a4w):
    """The device runs one token per call, reading the KV cache earlier calls wrote. The cache read, the
    keep-mask product and the cache update share one encoding, so prefill + decode and token-by-token
    calls compute what one whole call computes (without it, every one-token call clamped the cached keys
    to the near-zero range its moving-average observer had learnt from the empty cache)."""
    _checkpoint, _program, simulated = tiny_qnn_16a4w
    tokens = torch.tensor([[3, 5, 7, 2, 9, 4, 8, 6]])
    n = tokens.shape[1]

    def fresh():
        for name, buffer in simulated.named_buffers():
            if name.endswith("_cache"):
                buffer.zero_()

    with torch.no_grad():
        fresh()
        whole = simulated(tokens, torch.tensor([0]))
        fresh()
        prefill = simulated(tokens[:, :-2], torch.tensor([0]))
        decoded = torch.cat([simulated(tokens[:, i:i + 1], torch.tensor([i])) for i in (n - 2, n - 1)], dim=1)
        fresh()
        steps = torch.cat([simulated(tokens[:, i:i + 1], torch.tensor([i])) for i in range(n)], dim=1)
    spread = whole.abs().max().item()
    assert (torch.cat([prefill, decoded], dim=1) - whole).abs().max().item() < 0.02 * spread
    assert (steps - whole).abs().max().item() < 0.02 * spread
    assert torch.equal(steps.argmax(-1), whole.argmax(-1))


def test_without_qnn_libraries_lowering_fails_fast_with_what_to_install(no_qnn_libraries):
    from recipes.backends.qnn import qnn_partitioners

    started = time.perf_counter()
    with pytest.raises(UserFacingError) as err:
        qnn_partitioners({"soc": "SM8650"})
    assert time.perf_counter() - started < 2.0
    message = str(err.value)
    assert "QNN_SDK_ROOT" in message and "2.37.0.250724" in message and "onnxruntime-qnn==2.3.0" in message


def test_side_by_side_without_qnn_libraries_completes_xnnpack_and_records_qnn_error(
    tiny_llama_dir, tmp_path, no_qnn_libraries
):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path / "out"
    summary = run(RunRequest(recipes=["xnnpack-fp32", "qnn-16a4w"], out_dir=out, model=str(tiny_llama_dir),
                             prompt="what is the capital ?", max_new_tokens=4, max_seq_len=32))
    xnnpack, qnn = summary.recipes
    assert xnnpack.errors == [] and (out / "xnnpack-fp32" / "model.pte").is_file()
    assert xnnpack.generations[1].engine == "executorch-runtime"
    assert [e.stage for e in qnn.errors] == ["lower"]
    assert "QNN_SDK_ROOT" in qnn.errors[0].message and "traceback" not in qnn.errors[0].to_dict()
    assert qnn.generations[1].engine == "eager-qnn-simulated"
    assert qnn.timings.calibration.prompts >= 1
    assert not (out / "qnn-16a4w" / "model.pte").exists()
    rows = json.loads((out / "summary.json").read_text())
    assert rows[1]["engine"] == "eager-qnn-simulated" and "QNN_SDK_ROOT" in rows[1]["error"]


def _has_qnn_libraries() -> bool:
    from recipes.backends.qnn import find_qnn_libraries

    return find_qnn_libraries() is not None


needs_qnn = pytest.mark.skipif(not _has_qnn_libraries(), reason="no QNN host libraries (pip install onnxruntime-qnn==2.3.0)")


_RUNNER_AFTER_QNN = """
import sys
from recipes.running import llm_runner
from recipes.backends import qnn
qnn.load_qnn_libraries()
try:
    llm_runner.generate_with_runner(sys.argv[1], sys.argv[2], None, "hi", 2)
except llm_runner.RunnerFailed as err:
    print(err)
"""


@needs_qnn
def test_the_llm_runner_still_reports_its_errors_once_qnn_libraries_are_loaded(tmp_path):
    """The wheel's QNN libraries carry their own C++ runtime; the runner loaded after them must still throw and
    catch its C++ exceptions (here: a tokenizer it cannot read) instead of crashing the process."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "model.pte").write_bytes(b"not a program")
    (tmp_path / "tokenizer.json").write_text("{}")
    done = subprocess.run([sys.executable, "-c", _RUNNER_AFTER_QNN, str(tmp_path / "model.pte"),
                           str(tmp_path / "tokenizer.json")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not load model.pte with tokenizer.json" in done.stdout


@needs_qnn
def test_tiny_llama_lowers_to_one_qnn_htp_program(tiny_llama_dir, tmp_path):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path / "out"
    summary = run(RunRequest(recipes=["qnn-16a4w"], out_dir=out, model=str(tiny_llama_dir),
                             prompt="what is the capital ?", max_new_tokens=4, max_seq_len=32))
    report = summary.recipes[0]
    assert report.errors == [], report.errors
    options = report.recipe.options
    assert options["soc"] == "SM8650" and options["htp_arch"] == "v75"
    assert options["qnn_libraries"]
    ops = {o.op: o for o in report.delegation.ops}
    # the 15 linears, as 1x1 convolutions, in each of the hybrid program's two methods (prefill_forward, kv_forward)
    assert ops["aten_convolution_default"].delegated == 2 * (2 * 7 + 1)
    assert ops["aten_convolution_default"].non_delegated == 0
    # each method is one QNN partition, its embedding and rope lookups included
    assert report.delegation.delegated_subgraphs == 2
    assert "aten_index_put_default" not in ops and "copy_" not in ops
    assert report.generations[1].engine == "eager-qnn-simulated"
    assert "Qualcomm" in report.runtime_note
    pte = (out / "model.pte").read_bytes()
    assert b"QnnBackend" in pte and report.pte.bytes == len(pte)


@needs_qnn
def test_a_decoder_in_shards_compiles_one_qnn_graph_per_shard_with_every_linear_inside(tiny_llama_dir, tmp_path):
    """One decoder layer per shard: in each of the hybrid program's two methods the two layers become two QNN
    graphs, the residual stream passing between them through the one clone QNN leaves out; no linear leaves HTP."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path / "out"
    summary = run(RunRequest(recipes=["qnn-16a4w"], out_dir=out, model=str(tiny_llama_dir), max_seq_len=32,
                             max_new_tokens=4, generate=False, options={"layers_per_shard": 1}))
    report = summary.recipes[0]
    assert report.errors == [], report.errors
    assert report.recipe.options["layers_per_shard"] == 1
    ops = {o.op: o for o in report.delegation.ops}
    assert ops["aten_convolution_default"].delegated == 2 * (2 * 7 + 1)
    assert ops["aten_convolution_default"].non_delegated == 0
    assert ops["dim_order_ops__clone_dim_order_default"].non_delegated == 2
    assert "aten_index_put_default" not in ops
    assert report.delegation.delegated_subgraphs == 4
    assert (out / "model.pte").read_bytes().count(b"QnnBackend") >= 3


@pytest.mark.parametrize("value", [0, "two"])
def test_a_shard_size_that_is_not_a_positive_layer_count_is_refused_before_any_work(value, tmp_path):
    from models.errors import UserFacingError
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path / "out"
    with pytest.raises(UserFacingError, match="layers_per_shard must be a whole number of decoder layers"):
        run(RunRequest(recipes=["qnn-16a4w"], out_dir=out, options={"layers_per_shard": value}))
    assert not out.exists() or not any(out.iterdir())


@needs_qnn
def test_block_quantized_linears_wider_than_256_outputs_lower_for_real(wide_llama_dir, tmp_path):
    """qnn-16a4w's 4-bit blocks on 512-wide outputs: as FullyConnected, QNN 2.47's HTP graph prepare fails
    ("no properties registered for q::GenPad"); as the 1x1 conv2d the recipe lowers, it makes a context binary."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path / "out"
    summary = run(RunRequest(recipes=["qnn-16a4w"], out_dir=out, model=str(wide_llama_dir), max_seq_len=32, max_new_tokens=4,
                             generate=False))
    report = summary.recipes[0]
    assert report.errors == [], report.errors
    ops = {o.op: o for o in report.delegation.ops}
    assert ops["aten_convolution_default"].delegated == 2 * (7 + 1)  # in each of the hybrid program's two methods
    assert ops["aten_convolution_default"].non_delegated == 0
    assert b"QnnBackend" in (out / "model.pte").read_bytes()


@needs_qnn
def test_the_block_scales_qnn_encodes_are_the_ones_the_weights_and_the_simulation_use(tiny_checkpoint,
                                                                                      monkeypatch, tmp_path):
    """QNN stores a 4-bit block's scale as k/16 of its channel's largest (k in 1..16) and keeps the integer
    weights convert_pt2e made. The scales its node visitor really encodes, read back from a real lowering,
    must equal the scales that quantized those weights, which the simulation dequantizes with."""
    from executorch.backends.qualcomm.builders.node_visitor import NodeVisitor
    from executorch.backends.qualcomm.utils.constants import QCOM_BLOCK_SCALE_OFFSET, QCOM_BLOCK_SCALES, QCOM_SCALE

    from models.llama import build_exportable
    from quant.calibration import calibration_inputs
    from recipes.lowering.lower import Lowering, export_program, lower_for_backend
    from recipes.registry import get_recipe
    from recipes.pipeline.prepare import quantize_exported

    encoded = {}  # weight node -> (scales that quantized it, scales QNN encodes); the partitioner's op check and
    real = NodeVisitor.make_qnn_per_block_config  # the compile both visit it

    def recording(self, node, quant_attrs):
        encoding, config = real(self, node, quant_attrs)
        channels = len(config[QCOM_BLOCK_SCALE_OFFSET])
        per_channel = torch.tensor(config[QCOM_BLOCK_SCALE_OFFSET]["scale"]).unsqueeze(-1)
        blocks = torch.tensor(config[QCOM_BLOCK_SCALES].astype("int64")).reshape(channels, -1)
        encoded[node.name] = (quant_attrs[QCOM_SCALE].reshape(channels, -1).float(), per_channel * blocks)
        return encoding, config

    monkeypatch.setattr(NodeVisitor, "make_qnn_per_block_config", recording)
    recipe = get_recipe("qnn-16a4w")
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, recipe.export_options(32))
    program, simulated = quantize_exported(recipe, export_program(module, 32), calibration_inputs(
        tiny_checkpoint.tokenizer, 32), dict(recipe.options), 32)
    lower_for_backend(program, recipe, dict(recipe.options), Lowering(pte_path=tmp_path / "model.pte"))

    assert len(encoded) == 2 * 7  # every layer linear; the output layer is 8-bit per channel
    simulated_scales = [getattr(simulated, n.args[2].target) for n in simulated.graph.nodes
                        if n.op == "call_function" and "dequantize_affine" in str(n.target)]
    for scales_of_the_weights, scales_on_the_device in encoded.values():
        assert torch.allclose(scales_on_the_device, scales_of_the_weights, rtol=1e-6, atol=0)
        assert any(s.shape == scales_of_the_weights.shape and torch.equal(s.float(), scales_of_the_weights)
                   for s in simulated_scales)


@needs_qnn
@pytest.mark.builtin
@pytest.mark.skipif(
    os.environ.get("LOWERBENCH_QNN_BUILTIN") != "1",
    reason="opt-in (LOWERBENCH_QNN_BUILTIN=1): PT2E calibration + QNN lowering of all 30 layers takes 5 minutes on "
    "2 cores, too much for the suite's 20-minute budget; the tiny and wide one-layer tests cover the real QNN path",
)
def test_builtin_model_lowers_to_qnn_with_delegated_linears(tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", "--recipe", "qnn-16a4w", "--out", str(out), "--max-seq-len", "128", "--max-new-tokens", "8",
                     timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    linear = {o["op"]: o for o in report["delegation"]["ops"]}["aten_convolution_default"]  # linears as 1x1 conv2d
    assert linear["delegated"] == 30 * 7 + 1 and linear["non_delegated"] == 0
    assert report["generations"][1]["engine"] == "eager-qnn-simulated"
    assert report["recipe"]["options"]["htp_arch"] == "v75"
