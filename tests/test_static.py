"""The static-shape form (models/static_llama.py) and its runner (recipes/static_runner.py, shipped as
run_static.py): the same model as the dynamic module, and the same tokens through the ExecuTorch runtime."""
import torch


def _dynamic_and_static(checkpoint, context: int, max_outputs: int | None):
    from models.llama import ExportOptions, build_exportable
    from recipes.static_program import static_form

    dynamic = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa"))
    base = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(context, attention="sdpa-slice"))
    return dynamic, static_form(base, {"max_linear_outputs": max_outputs})


def test_static_logits_equal_dynamic_on_the_evaluation_text(tiny_checkpoint):
    """fp32: every position's logits of the evaluation text, prefilled in chunks of 8 (the last one padded) and then
    decoded token by token, equal the dynamic module's; linears split to 8 outputs compute the same."""
    from recipes import fidelity
    from recipes.generate import eager_step
    from recipes.static_program import eager_session

    context = 48
    dynamic, static = _dynamic_and_static(tiny_checkpoint, context, 8)
    assert any(type(m).__name__ == "SplitLinear" for m in static.modules())
    ids = fidelity.eval_token_ids(tiny_checkpoint.tokenizer)[:context]
    expected = fidelity.sequence_logits(eager_step(dynamic), ids, context)
    chunked = fidelity.sequence_logits(eager_session(static, 8).step, ids, context)
    assert chunked.shape == expected.shape
    assert (chunked - expected).abs().max().item() < 1e-4
    session = eager_session(static, 8)
    prefix = 13  # a prefill of one full chunk and a padded one, then decode steps
    decoded = [session.feed(ids[:prefix])[-1]] + [session.feed([t])[-1] for t in ids[prefix:context - 1]]
    assert (torch.stack(decoded) - expected[prefix - 1:context - 1]).abs().max().item() < 1e-4
