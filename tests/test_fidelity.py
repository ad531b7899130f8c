"""Fidelity: perplexity, top-1 agreement and KL against fp32 eager, on the shipped evaluation text."""
import pytest
import torch
from torch import nn

from recipes.evaluation import fidelity


def test_identical_logits_agree_fully():
    torch.manual_seed(0)
    logits = torch.randn(50, 40)
    targets = torch.randint(0, 40, (50,))
    figures = fidelity.compare(logits, logits.clone(), targets)
    assert figures["top1_agreement_percent"] == 100.0
    assert figures["mean_kl"] == 0.0
    assert figures["perplexity_ratio"] == 1.0


def test_windows_cover_the_text_and_match_their_targets():
    ids = list(range(10, 10 + 150))
    calls = []

    def step(tokens, input_pos):
        calls.append((tokens.shape[1], int(input_pos[0])))
        return torch.nn.functional.one_hot(tokens + 1, 200).float()  # "predicts" the next id

    logits = fidelity.sequence_logits(step, ids, 64)
    targets = fidelity.targets_of(ids, 64)
    assert calls == [(64, 0), (64, 0), (22, 0)]
    assert logits.shape == (len(targets), 200) == (150 - 3, 200)
    assert torch.equal(logits.argmax(-1), targets)


def test_windows_survive_a_step_that_lends_one_buffer():
    """The runtime's step returns its own output buffer, which the next window's call overwrites."""
    ids = list(range(10, 10 + 150))
    lent = torch.zeros(1, 64, 200)

    def step(tokens, input_pos):
        logits = lent[:, : tokens.shape[1]]
        logits.zero_()
        logits.copy_(torch.nn.functional.one_hot(tokens + 1, 200).float())
        return logits

    logits = fidelity.sequence_logits(step, ids, 64)
    assert torch.equal(logits.argmax(-1), fidelity.targets_of(ids, 64))


def test_a_window_at_a_time_scores_as_the_whole_text_at_once():
    """compare_step scores each window as it comes, from a step that lends one output buffer, and gives the figures
    compare gives on the whole text's logits."""
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (150,)).tolist()
    weights = torch.randn(200, 200)
    lent = torch.zeros(1, 64, 200)

    def step(tokens, input_pos):
        logits = lent[:, : tokens.shape[1]]
        logits.copy_(weights[tokens] + 0.3 * torch.randn(tokens.shape[1], 200))
        return logits

    reference = torch.randn(147, 200)
    targets = fidelity.targets_of(ids, 64)
    torch.manual_seed(1)
    whole = fidelity.compare(reference, fidelity.sequence_logits(step, ids, 64), targets)
    torch.manual_seed(1)
    windowed = fidelity.compare_step(step, ids, 64, reference, targets)
    assert windowed == pytest.approx(whole, rel=1e-9)
    assert 0 < windowed["top1_agreement_percent"] < 100 and windowed["mean_kl"] > 0


def test_eval_text_is_shipped_and_tokenizes(tiny_checkpoint):
    text = fidelity.EVAL_TEXT.read_text()
    assert text.startswith("It is a truth universally acknowledged") and len(text.split()) > 250
    assert len(fidelity.eval_token_ids(tiny_checkpoint.tokenizer)) > 100


def test_broken_scheme_shows_degraded_figures():
    """2-bit weights in one group of 1024 wreck a hidden-1024 model; the figures must say so."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.llama import ExportOptions, build_exportable
    from quant.schemes import apply_scheme
    from recipes.running.generate import eager_step

    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8, initializer_range=0.1)
    torch.manual_seed(0)
    state_dict = LlamaForCausalLM(config).state_dict()
    ids = torch.randint(0, 512, (200,)).tolist()
    targets = fidelity.targets_of(ids, 128)

    def step(quantize):
        module = build_exportable(config, state_dict, ExportOptions(128, attention="sdpa"))
        quantize(module)
        return eager_step(module)

    reference = fidelity.sequence_logits(step(lambda m: None), ids, 128)

    def report(quantize):
        figures = fidelity.compare_step(step(quantize), ids, 128, reference, targets)
        return fidelity.fidelity_report("eager-quantized", "8da4w", figures, len(targets))

    good = report(lambda m: apply_scheme(m, "8da4w", 32, "hqq"))
    broken = report(lambda m: quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(1024)),
                                        filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear)))
    assert good.meets_target is True
    assert broken.meets_target is False and broken.perplexity_ratio > 2
    assert broken.mean_kl > 4 * good.mean_kl
    assert broken.top1_agreement_percent < good.top1_agreement_percent - 20


def test_tiny_run_reports_fidelity_per_recipe(tiny_llama_dir, tmp_path):
    from recipes.output.summary import summary_rows
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    summary = run(RunRequest(recipes=["xnnpack-fp32", "xnnpack-8da4w"], out_dir=tmp_path, model=str(tiny_llama_dir),
                             max_seq_len=64, max_new_tokens=4, prompt="what is the capital ?", layer_map=True))
    for report in summary.recipes:
        assert report.errors == []
        figures = report.fidelity
        assert figures.engine == "executorch-runtime"
        assert figures.positions > 50
        assert figures.perplexity_fp32 > 0 and figures.perplexity > 0 and figures.mean_kl >= 0
    for report in summary.recipes:
        heldout = report.fidelity.heldout
        assert heldout.text.startswith("quant/eval_text_heldout.txt") and heldout.positions > 50
        layers = report.fidelity.layers
        assert layers.engine == "executorch-runtime" and "intermediate_output_tap" in layers.method
        assert [row.layer for row in layers.layers] == [0, 1]
    fp32 = summary.recipes[0].fidelity
    assert fp32.top1_agreement_percent == 100.0 and fp32.meets_target is True
    assert fp32.mean_kl < 1e-6 and fp32.heldout.top1_agreement_percent == 100.0
    # the .pte's layer outputs, read inside the XNNPACK delegate, are fp32 eager's
    assert all(row.sqnr_db is None or row.sqnr_db >= 60 for row in fp32.layers.layers), fp32.layers
    int4_layers = summary.recipes[1].fidelity.layers.layers
    assert all(row.sqnr_db < 60 for row in int4_layers), int4_layers
    rows = summary_rows(summary)
    assert rows[1]["perplexity vs fp32 (×)"] == round(summary.recipes[1].fidelity.perplexity_ratio, 3)
    assert rows[1]["held-out (×)"] == round(summary.recipes[1].fidelity.heldout.perplexity_ratio, 3)
    assert rows[0]["fidelity target"] == "top-1 agreement with fp32 eager = 100 %: yes"
    assert rows[0]["top-1 agreement (%)"] == 100.0 and rows[0]["error"] == "–"


def test_layer_map_of_a_broken_2bit_scheme_is_low(tiny_checkpoint):
    """2-bit weights in one group per row: every layer's SQNR is low (eager hooks, labelled so)."""
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from models.llama import ExportOptions, build_exportable
    from quant.layer_error import eager_layer_outputs
    from recipes.evaluation.layer_map import layer_map, windows_of

    ids = fidelity.eval_token_ids(tiny_checkpoint.tokenizer)
    windows = windows_of(ids, 64)
    reference = eager_layer_outputs(
        build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(64, attention="sdpa")),
        windows)
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(64, attention="sdpa"))
    quantize_(module, IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(64)),
              filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))
    broken = layer_map("eager-quantized", "eager forward hooks", reference, eager_layer_outputs(module, windows))
    assert all(row.sqnr_db < 10 and row.relative_error > 0.3 for row in broken.layers), broken


def test_sqnr_chart_rows_give_one_line_per_recipe():
    from recipes.evaluation.layer_map import sqnr_chart_rows
    from recipes.output.report import Report

    reports = [{"recipe": {"name": name}, "fidelity": {"layers": {"layers": [
        {"layer": 0, "sqnr_db": db, "relative_error": 0.1}, {"layer": 1, "sqnr_db": None, "relative_error": 0.0}]}}}
        for name, db in (("xnnpack-8da4w", 20.0), ("xnnpack-fp32", 130.0))] + [{"recipe": {"name": "x"}, "fidelity": None}]
    reports = [Report.from_dict(report) for report in reports]
    assert sqnr_chart_rows(reports) == [{"recipe": "xnnpack-8da4w", "layer": 0, "sqnr_db": 20.0},
                                        {"recipe": "xnnpack-fp32", "layer": 0, "sqnr_db": 130.0}]


@pytest.mark.builtin
def test_builtin_xnnpack_fp32_agrees_fully_with_eager(builtin_fp32_run):
    _out, report, _shown = builtin_fp32_run
    figures = report["fidelity"]
    assert figures["engine"] == "executorch-runtime"
    assert figures["top1_agreement_percent"] == 100.0, figures
    assert figures["meets_target"] is True
    assert figures["perplexity"] == pytest.approx(figures["perplexity_fp32"], rel=1e-3)


@pytest.mark.builtin
def test_builtin_xnnpack_8da4w_reports_its_target(builtin_8da4w_run):
    """The report judges 8da4w against its perplexity target and says whether it meets it."""
    _out, report, _shown = builtin_8da4w_run
    figures = report["fidelity"]
    assert figures["engine"] == "executorch-runtime"
    assert figures["perplexity_fp32"] < figures["perplexity"] < 3 * figures["perplexity_fp32"], figures
    assert figures["meets_target"] is (figures["perplexity_ratio"] <= 1.10)
    assert 0 < figures["top1_agreement_percent"] < 100 and figures["mean_kl"] > 0


# torchao's own AWQ search (its AWQObserver, every candidate on every calibration token) on the built-in model: the
# eager xnnpack-8da4w module's mean KL from fp32 on the evaluation and held-out texts, the larger of its two
# measurements, on AMD EPYC with AVX-512 (0.333 / 0.319) and with AVX2 only (0.3435 / 0.3193; docs/quantization.md):
# the CPU's kernels move even its choices. The default's shortcuts must not cost fidelity against it; the default's
# `.pte` measured 0.299-0.300 and 0.295-0.306 on those CPUs.
EXHAUSTIVE_AWQ_MEAN_KL = {"evaluation": 0.3435, "held-out": 0.3193}


@pytest.mark.builtin
def test_builtin_default_is_no_farther_from_fp32_than_torchaos_own_awq_search(builtin_8da4w_run):
    _out, report, _shown = builtin_8da4w_run
    figures = report["fidelity"]
    assert report["recipe"]["options"]["quant_algorithm"] == "awq"
    measured = {"evaluation": figures["mean_kl"], "held-out": figures["heldout"]["mean_kl"]}
    print(f"the default's mean KL {measured} against torchao's search {EXHAUSTIVE_AWQ_MEAN_KL}")
    assert all(measured[text] <= EXHAUSTIVE_AWQ_MEAN_KL[text] for text in measured), measured


def test_layer_major_reference_gives_the_ordinary_references_logits(tiny_checkpoint):
    """Scored one unit at a time from the checkpoint, the fp32 reference's logits on both texts (several windows
    each) equal those of the whole fp32 module run window by window."""
    import torch

    from models.llama import ExportOptions, build_exportable
    from recipes.evaluation import fidelity
    from recipes.running import generate as gen
    from recipes.evaluation.layer_major_reference import layer_major_scores

    ckpt, max_seq_len = tiny_checkpoint, 32
    texts = [fidelity.eval_token_ids(ckpt.tokenizer, text)[:150] for text in (fidelity.EVAL_TEXT, fidelity.HELDOUT_TEXT)]
    assert all(len(ids) > 2 * max_seq_len for ids in texts)
    module = build_exportable(ckpt.config, ckpt.state_dict, ExportOptions(max_seq_len, attention="sdpa",
                                                                        dtype=torch.float32), tie_output=True)
    ordinary = [fidelity.score_text(gen.eager_step(module), ids, max_seq_len) for ids in texts]
    layer_major = layer_major_scores(ckpt.config, ckpt.state_dict, texts, max_seq_len)
    for whole, by_layer in zip(ordinary, layer_major):
        assert by_layer.ids == whole.ids and torch.equal(by_layer.targets, whole.targets)
        torch.testing.assert_close(by_layer.logits, whole.logits, rtol=0, atol=1e-5)
