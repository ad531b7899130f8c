"""run_static.py: drives a static-shape LLM program, whose caches and masks are inputs and outputs (the Core ML
Neural Engine recipes, and their XNNPACK twin), on the ExecuTorch runtime's Python API. ExecuTorch's C++
TextLLMRunner cannot: it expects one `forward` method that keeps its KV cache as state.

The .pte has two methods, `prefill` (a fixed chunk of tokens) and `decode` (one token), each called as
(tokens[1, T], input_pos[1], mask[1, 1, T, C + T], k_cache x layers, v_cache x layers) and returning
(logits[1, T, vocab], new k rows x layers, new v rows x layers); its constant methods give T, the cache shape and
dtype. This file holds the caches, writes each call's new rows at its position, builds the masks, prefills the
prompt chunk by chunk (the last chunk padded), decodes greedily (or samples) until a stop id, and applies the chat
template from tokenizer_config.json. It is copied beside model.pte, so it imports nothing of the project:

    pip install executorch transformers
    python run_static.py --prompt "What is the capital of France?" [--max-new-tokens 64] [--dir FOLDER]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

PREFILL, DECODE = "prefill", "decode"
MASK_BLOCKED = float("-inf")
# Metadata methods the program carries for this file (beside the LLM runners' usual ones).
STATIC_METADATA = ("get_prefill_len", "get_decode_len", "get_kv_cache_shape", "get_kv_cache_fp16")


def causal_mask(start: int, valid: int, tokens: int, context: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, tokens, context + tokens]: query i (position start + i) attends to cache rows 0 .. start - 1 and to
    this call's tokens 0 .. i; padding queries (i >= valid) attend to themselves only, so no row is all -inf."""
    mask = torch.full((1, 1, tokens, context + tokens), MASK_BLOCKED, dtype=dtype)
    mask[..., :start] = 0
    own = torch.tril(torch.ones(tokens, tokens, dtype=torch.bool))
    own[valid:] = torch.eye(tokens, dtype=torch.bool)[valid:]
    mask[0, 0, :, context:].masked_fill_(own, 0)
    return mask


class StaticSession:
    """One sequence over a static program. `call(method, inputs) -> outputs` runs a method on flat inputs
    (tokens, input_pos, mask, k caches, v caches) and returns flat outputs (logits, new k rows, new v rows): the
    .pte's methods on the runtime, or the same module in PyTorch."""

    def __init__(self, call: Callable[[str, list], Sequence[torch.Tensor]], prefill_len: int, n_layers: int,
                 cache_shape: Sequence[int], dtype: torch.dtype):
        self.call, self.prefill_len, self.n_layers = call, prefill_len, n_layers
        self.cache_shape, self.dtype = tuple(cache_shape), dtype
        self.context = self.cache_shape[2]
        self.k = [torch.zeros(self.cache_shape, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(self.cache_shape, dtype=dtype) for _ in range(n_layers)]
        self.position = 0
        self.stop_ids: tuple[int, ...] = ()  # the program's get_eos_ids, where it has them

    def reset(self) -> None:
        # Rows past the position are masked, so zeroing only keeps runs reproducible.
        for cache in (*self.k, *self.v):
            cache.zero_()
        self.position = 0

    def _run(self, method: str, tokens: list[int], width: int) -> torch.Tensor:
        """Runs `tokens` (at most `width`, padded to it) at the current position; the logits of the real ones."""
        start, valid = self.position, len(tokens)
        if start + valid > self.context:
            raise ValueError(f"{start + valid} tokens exceed the program's context of {self.context}")
        ids = torch.zeros((1, width), dtype=torch.long)
        ids[0, :valid] = torch.tensor(tokens, dtype=torch.long)
        mask = causal_mask(start, valid, width, self.context, self.dtype)
        outputs = self.call(method, [ids, torch.tensor([start], dtype=torch.long), mask, *self.k, *self.v])
        logits = outputs[0][0, :valid].clone()
        for cache, rows in zip((*self.k, *self.v), outputs[1:1 + 2 * self.n_layers]):
            cache[:, :, start:start + valid] = rows[:, :, :valid]
        self.position += valid
        return logits

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """logits[len(tokens), vocab] of tokens appended at the current position: one token by `decode`, more by
        `prefill` chunks."""
        if len(tokens) == 1:
            return self._run(DECODE, tokens, 1)
        chunks = [tokens[i:i + self.prefill_len] for i in range(0, len(tokens), self.prefill_len)]
        return torch.cat([self._run(PREFILL, chunk, self.prefill_len) for chunk in chunks])

    def step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """The dynamic program's interface, step(tokens[1, T], input_pos[1]) -> logits[1, T, vocab]: a call at
        position 0 starts a new sequence."""
        start = int(input_pos[0])
        if start == 0:
            self.reset()
        if start != self.position:
            raise ValueError(f"the session is at position {self.position}, not {start}")
        return self.feed(tokens[0].tolist())[None]


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1, generator=generator))


def generate(session: StaticSession, prompt_ids: list[int], max_new_tokens: int, stop_ids=(),
             temperature: float = 0.0, seed: int = 0, on_token: Callable[[int], None] | None = None) -> dict:
    """New token ids (the stop id included when one ends it) and the prefill and decode rates."""
    generator = torch.Generator().manual_seed(seed)
    session.reset()
    started = time.perf_counter()
    next_id = pick(session.feed(list(prompt_ids))[-1], temperature, generator)
    prefill_s = time.perf_counter() - started
    out = [next_id]
    started = time.perf_counter()
    while next_id not in stop_ids and len(out) < max_new_tokens:
        if on_token:
            on_token(next_id)
        next_id = pick(session.feed([next_id])[-1], temperature, generator)
        out.append(next_id)
    if on_token and next_id not in stop_ids:
        on_token(next_id)
    decode_s = time.perf_counter() - started
    return {"tokens": out, "prefill_tokens_per_s": len(prompt_ids) / prefill_s if prefill_s else 0.0,
            "decode_tokens_per_s": (len(out) - 1) / decode_s if decode_s and len(out) > 1 else 0.0}


def load_program(pte: Path):
    """(the runtime's program, its prefill and decode methods, its constants). Importing ExecuTorch's LLM custom
    ops and quantized kernels first lets a .pte that uses them load (they are absent from some installs)."""
    for name in ("executorch.extension.llm.custom_ops.custom_ops", "executorch.kernels.quantized"):
        try:
            __import__(name)
        except ImportError:
            pass
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte))
    constants = {}
    for name in (*STATIC_METADATA, "get_n_layers", "get_eos_ids", "get_max_context_len"):
        if name in program.method_names:
            values = program.load_method(name).execute([])
            constants[name] = values if name in ("get_kv_cache_shape", "get_eos_ids") else values[0]
    missing = [name for name in STATIC_METADATA if name not in constants]
    if missing:
        raise SystemExit(f"{pte} is not a static-shape program (no {', '.join(missing)}); "
                         "run it with ExecuTorch's TextLLMRunner instead.")
    methods = {name: program.load_method(name) for name in (PREFILL, DECODE)}
    return program, methods, constants


def runtime_session(pte: Path) -> StaticSession:
    program, methods, constants = load_program(pte)

    def call(method: str, inputs: list) -> Sequence[torch.Tensor]:
        return methods[method].execute(inputs)

    call.program = program  # the methods borrow from the program: keep it alive with them
    dtype = torch.float16 if constants["get_kv_cache_fp16"] else torch.float32
    session = StaticSession(call, int(constants["get_prefill_len"]), int(constants["get_n_layers"]),
                            [int(v) for v in constants["get_kv_cache_shape"]], dtype)
    session.stop_ids = tuple(int(i) for i in constants.get("get_eos_ids", ()))
    return session


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the model's chat template writes it (tokenizer_config.json), or as plain text without one."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=str(Path(__file__).resolve().parent),
                        help="the folder with model.pte and the tokenizer (default: this file's)")
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    folder = Path(args.dir)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    session = runtime_session(folder / "model.pte")
    stops = set(session.stop_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    ids = chat_prompt_ids(tokenizer, args.prompt)
    room = session.context - len(ids)
    result = generate(session, ids, min(args.max_new_tokens, room), stops, args.temperature,
                      on_token=lambda t: print(tokenizer.decode([t]), end="", flush=True))
    print()
    print(f"prefill {result['prefill_tokens_per_s']:.1f} tok/s, decode {result['decode_tokens_per_s']:.1f} tok/s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
