"""recipes/running/generate.py: the choice of the next token, the generation loop and the runtime step."""
import torch

from recipes.running.generate import generate, pick_next


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


class _PlainTokenizer:
    """No chat template: the prompt's ids are its characters' codes mod 16; no end-of-sequence token."""

    eos_token_id = None

    def encode(self, text):
        return [ord(c) % 16 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def test_loop_gives_each_step_its_own_token_and_position_and_reads_lent_logits():
    """The loop writes every step's token and position into the same two tensors, and a step may lend one
    logits buffer that its next call overwrites (the runtime's does): each step must still get its own
    inputs, and each token must come from its own step's logits."""
    vocab = 16
    lent = torch.zeros(1, 1, vocab)
    seen = []

    def step(tokens, input_pos):
        seen.append((tokens[0].tolist(), int(input_pos[0])))
        logits = lent if tokens.shape[1] == 1 else torch.zeros(1, tokens.shape[1], vocab)
        logits.zero_()
        logits[0, -1, (int(tokens[0, -1]) * 3 + int(input_pos[0])) % vocab] = 1.0
        return logits

    result = generate(step, "test", _PlainTokenizer(), "ab", max_new_tokens=5, max_seq_len=32)
    prompt = [ord("a") % 16, ord("b") % 16]  # 1, 2
    expected, last = [], prompt[-1]
    for i in range(5):  # prefill starts at 0 and predicts from its last token; then one step per token
        last = (last * 3 + (0 if i == 0 else len(prompt) + i - 1)) % vocab
        expected.append(last)
    assert seen == [(prompt, 0)] + [([t], len(prompt) + i) for i, t in enumerate(expected[:-1])]
    assert result.text == " ".join(str(t) for t in expected)
    assert result.new_tokens == 5 and result.prompt_tokens == 2


def test_runtime_step_lends_its_output_and_generation_matches_eager(tiny_fp32_lowered, tiny_checkpoint):
    """On the real runtime: the step's logits are the runtime's buffer (the next call overwrites them), and
    greedy generation through it gives the eager module's tokens."""
    from recipes.running.generate import eager_step, load_runtime_method, runtime_step

    module, lowered, recipe = tiny_fp32_lowered
    step = runtime_step(load_runtime_method(lowered.pte, recipe.backend.runtime_imports))
    first = step(torch.tensor([[3, 5, 7]]), torch.tensor([0]))
    kept = first.clone()
    second = step(torch.tensor([[9]]), torch.tensor([3]))
    assert second.data_ptr() == first.data_ptr() and not torch.equal(first, kept)

    tokenizer = tiny_checkpoint.tokenizer
    runtime = generate(step, "executorch-runtime", tokenizer, "hello there", max_new_tokens=12, max_seq_len=64)
    eager = generate(eager_step(module), "eager-fp32", tokenizer, "hello there", max_new_tokens=12, max_seq_len=64)
    assert runtime.text == eager.text and runtime.new_tokens == eager.new_tokens


def test_runtime_without_the_flag_keeps_its_own_copying_execute():
    from recipes.running.generate import _borrowing_call

    class Method:  # an executorch.runtime Method whose pybind call has no clone_outputs
        class _Bound:
            def __call__(self, inputs):
                raise AssertionError("must not be called directly")

        _method = _Bound()

        def execute(self, inputs):
            return ["copied"]

    method = Method()
    assert _borrowing_call(method)([]) == ["copied"]


def test_runtime_step_keeps_its_program_alive(tiny_fp32_lowered):
    """A caller may keep only the step (recipes/pipeline/run.py does), and the method borrows from its program, which
    holds the .pte bytes: once they were collected, a step over a 12 MB .pte segfaulted (measured)."""
    import gc
    import weakref

    from recipes.running.generate import load_runtime_method, runtime_step

    _module, lowered, recipe = tiny_fp32_lowered
    loaded = load_runtime_method(bytes(lowered.pte), recipe.backend.runtime_imports)
    program = weakref.ref(loaded[0])
    step = runtime_step(loaded)
    del loaded
    gc.collect()
    assert program() is not None
    assert step(torch.tensor([[3, 5, 7]]), torch.tensor([0])).shape[1] == 3


class _RecordingMethod:
    """A loaded method that records what it is called with (no pybind `_method`: the step uses `execute`)."""

    def __init__(self):
        self.calls = []

    def execute(self, inputs):
        tokens, input_pos = inputs
        self.calls.append((tokens.tolist(), input_pos.tolist()))
        return [torch.zeros(1, tokens.shape[1], 4)]


def test_runtime_step_warms_up_with_one_decode_call_at_load():
    from recipes.running.generate import runtime_step

    method = _RecordingMethod()
    step = runtime_step((None, method))
    assert method.calls == [([[0]], [0])]  # one token at position 0, before any caller's call
    step(torch.tensor([[4, 5]]), torch.tensor([0]))
    assert method.calls[1:] == [([[4, 5]], [0])]

    cold = _RecordingMethod()
    runtime_step((None, cold), warm=False)
    assert cold.calls == []


def test_warm_up_leaves_generation_unchanged(tiny_fp32_lowered):
    """The warm-up writes cache row 0; the next prefill starts there. A warmed and a cold load of the same
    .pte give bit-identical logits for a prefill and the decode steps after it."""
    from recipes.running.generate import load_runtime_method, runtime_step

    _module, lowered, recipe = tiny_fp32_lowered
    warmed = runtime_step(load_runtime_method(lowered.pte, recipe.backend.runtime_imports))
    cold = runtime_step(load_runtime_method(lowered.pte, recipe.backend.runtime_imports), warm=False)
    calls = [(torch.tensor([[3, 5, 7]]), torch.tensor([0]))] + [(torch.tensor([[t]]), torch.tensor([3 + i]))
                                                                for i, t in enumerate((9, 2, 11))]
    for tokens, position in calls:
        assert torch.equal(warmed(tokens, position).clone(), cold(tokens, position).clone())


_FIRST_CALL_FAULTS = """
import resource, sys
import torch
from recipes.running.generate import load_runtime_method, runtime_step
from recipes.backends.xnnpack import BACKEND
step = runtime_step(load_runtime_method(sys.argv[1], BACKEND.runtime_imports), warm=sys.argv[2] == "warm")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step(torch.zeros((1, 1), dtype=torch.long), torch.tensor([5]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_warm_up_takes_xnnpacks_workspace_setup_out_of_the_first_generation(builtin_8da4w_run):
    """The built-in 8da4w program plans and zeroes its XNNPACK workspace (about 6 MB) on its first call. Counted as fresh pages in the first decode-shaped call of a new process: cold, that call
    takes them; after the load's warm-up, it does not."""
    import subprocess
    import sys
    from pathlib import Path

    out, _report, _shown = builtin_8da4w_run
    root = Path(__file__).resolve().parent.parent

    def first_call_faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", _FIRST_CALL_FAULTS, str(out / "model.pte"), mode],
                              cwd=root, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.strip().splitlines()[-1])

    cold, warmed = first_call_faults("cold"), first_call_faults("warm")
    assert cold > 1000, cold  # ~1,500 pages of 4 KB: the workspace as it grows
    assert warmed < 200, warmed
