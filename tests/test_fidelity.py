"""Fidelity: perplexity, top-1 agreement and KL against fp32 eager, on the shipped evaluation text."""
import pytest
import torch
from torch import nn

from recipes import fidelity


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
    from recipes.generate import eager_step

    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8, initializer_range=0.1)
    torch.manual_seed(0)
    state_dict = LlamaForCausalLM(config).state_dict()
    ids = torch.randint(0, 512, (200,)).tolist()
    targets = fidelity.targets_of(ids, 128)

    def logits(quantize):
        module = build_exportable(config, state_dict, ExportOptions(128, attention="sdpa"))
        quantize(module)
        return fidelity.sequence_logits(eager_step(module), ids, 128)

    reference = logits(lambda m: None)
    good = fidelity.fidelity_report("eager-quantized", "8da4w", reference,
                                    logits(lambda m: apply_scheme(m, "8da4w", 32)), targets)
    broken = fidelity.fidelity_report("eager-quantized", "8da4w", reference, logits(lambda m: quantize_(
        m, IntxWeightOnlyConfig(weight_dtype=torch.int2, granularity=PerGroup(1024)),
        filter_fn=lambda mod, fqn: isinstance(mod, nn.Linear))), targets)
    assert good["meets_target"] is True
    assert broken["meets_target"] is False and broken["perplexity_ratio"] > 2
    assert broken["mean_kl"] > 4 * good["mean_kl"]
    assert broken["top1_agreement_percent"] < good["top1_agreement_percent"] - 20


def test_tiny_run_reports_fidelity_per_recipe(tiny_llama_dir, tmp_path):
    from recipes.run import RunRequest, run, summary_rows

    summary = run(RunRequest(recipes=["xnnpack-fp32", "xnnpack-8da4w"], out_dir=tmp_path, model=str(tiny_llama_dir),
                             max_seq_len=64, max_new_tokens=4, prompt="what is the capital ?"))
    for report in summary["recipes"]:
        assert report["errors"] == []
        figures = report["fidelity"]
        assert figures["engine"] == "executorch-runtime"
        assert figures["positions"] > 50
        assert figures["perplexity_fp32"] > 0 and figures["perplexity"] > 0 and figures["mean_kl"] >= 0
    fp32 = summary["recipes"][0]["fidelity"]
    assert fp32["top1_agreement_percent"] == 100.0 and fp32["meets_target"] is True
    assert fp32["mean_kl"] < 1e-6
    rows = summary_rows(summary)
    assert rows[1]["perplexity"] == summary["recipes"][1]["fidelity"]["perplexity"]
    assert {"top1_agreement_percent", "mean_kl", "meets_target", "perplexity_fp32"} <= set(rows[0])


@pytest.mark.builtin
def test_builtin_xnnpack_fp32_agrees_fully_with_eager(builtin_fp32_run):
    _out, report, _result = builtin_fp32_run
    figures = report["fidelity"]
    assert figures["engine"] == "executorch-runtime"
    assert figures["top1_agreement_percent"] == 100.0, figures
    assert figures["meets_target"] is True
    assert figures["perplexity"] == pytest.approx(figures["perplexity_fp32"], rel=1e-3)


@pytest.mark.builtin
def test_builtin_xnnpack_8da4w_reports_its_target(builtin_8da4w_run):
    """Measured here: perplexity ratio 1.54 (16.34 -> 25.23), so 8da4w misses its 1.10 target; the report says so."""
    _out, report, _result = builtin_8da4w_run
    figures = report["fidelity"]
    assert figures["engine"] == "executorch-runtime"
    assert figures["perplexity_fp32"] < figures["perplexity"] < 3 * figures["perplexity_fp32"], figures
    assert figures["meets_target"] is (figures["perplexity_ratio"] <= 1.10)
    assert 0 < figures["top1_agreement_percent"] < 100 and figures["mean_kl"] > 0
