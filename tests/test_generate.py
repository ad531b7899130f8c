"""recipes/generate.py's choice of the next token."""
import torch

from recipes.generate import pick_next


def test_greedy_pick_is_the_first_largest_logit_in_every_dtype():
    logits = torch.tensor([0.5, 3.0, -1.0, 3.0, 2.0])
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert pick_next(logits.to(dtype), 0.0, 1.0, None) == 1, dtype
    # a view into a batch of logits, as the loop passes it
    batch = torch.randn(1, 4, 49152)
    assert pick_next(batch[0, -1], 0.0, 1.0, None) == int(torch.argmax(batch[0, -1]))


def test_sampling_is_seeded_and_respects_top_p():
    logits = torch.tensor([4.0, 3.9, -10.0, -10.0])
    picks = {pick_next(logits, 1.0, 0.5, torch.Generator().manual_seed(s)) for s in range(20)}
    assert picks == {0}  # top_p 0.5 keeps only the most likely token
    first = [pick_next(logits, 1.0, 1.0, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(first)) == 1
