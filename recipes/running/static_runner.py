"""run_static.py: drives a static-shape LLM program, whose caches, masks and rope rows are inputs and outputs (the
Core ML Neural Engine recipes, and their XNNPACK twin), on the ExecuTorch runtime's Python API. ExecuTorch's C++
TextLLMRunner cannot: it expects one `forward` method that keeps its KV cache as state.

The program follows ExecuTorch's own static Llama export (examples/apple/coreml/llama/export_static_llm_coreml.py):
methods `forward` (one token: decode) and `prefill` (a fixed chunk), and constant methods that say where each input
sits (`{decode,prefill}_kv_cache_specs`: rows of k in, k out, v in, v out, cache length; `_mask_specs`;
`_freqs_{cos,sin}_input_index`), the rope rows of every position (`freqs_cos`, `freqs_sin`) and the chunk lengths.
Each call takes tokens[1, T] (int32), the additive mask[1, T, C + T], the rope rows of its positions, the caches
[1, kv heads, C, head_dim] and, last, the index of its last real token, and returns that token's logits and each
cache's new rows. This file holds the caches (slot = position, ExecuTorch's "smart mask" layout), builds the masks,
prefills the prompt chunk by chunk (the last chunk padded), decodes greedily (or samples) until a stop id, and
applies the chat template from tokenizer_config.json. It is copied beside model.pte, so it imports nothing of the
project:

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

PREFILL, DECODE = "prefill", "forward"
# The constant methods' prefix of each method (ExecuTorch's export names decode's metadata `decode_*`).
METADATA_PREFIX = {PREFILL: "prefill", DECODE: "decode"}
MASK_BLOCKED = float("-inf")
SHARED_METADATA = ("vocab_size", "head_dim", "n_heads_per_cache", "freqs_cos", "freqs_sin")
PER_METHOD_METADATA = ("input_len", "freqs_cos_input_index", "freqs_sin_input_index", "mask_specs", "kv_cache_specs")
# Every constant method this file reads; the LLM runners' get_eos_ids where the program has it.
STATIC_METADATA = SHARED_METADATA + tuple(f"{prefix}_{name}" for prefix in METADATA_PREFIX.values()
                                          for name in PER_METHOD_METADATA)


def causal_mask(start: int, tokens: int, cache_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, tokens, cache_len + tokens], as ExecuTorch's StaticAttentionIOManager builds it: every query attends to
    the cache's filled slots 0 .. start - 1 and causally to this call's tokens (padding ones too; their outputs are
    never read)."""
    mask = torch.full((1, tokens, cache_len + tokens), MASK_BLOCKED, dtype=dtype)
    mask[..., :min(start, cache_len)] = 0
    mask[0, :, cache_len:] = torch.triu(torch.full((tokens, tokens), MASK_BLOCKED, dtype=dtype), diagonal=1)
    return mask


class MethodLayout:
    """Where a method's inputs and outputs sit, from the program's constant methods for it."""

    def __init__(self, constants: dict, prefix: str):
        self.input_len = int(constants[f"{prefix}_input_len"])
        self.cos_input = int(constants[f"{prefix}_freqs_cos_input_index"][0])
        self.sin_input = int(constants[f"{prefix}_freqs_sin_input_index"][0])
        masks = [[int(v) for v in row] for row in constants[f"{prefix}_mask_specs"].tolist()]
        if len(masks) != 1:
            raise ValueError(f"{len(masks)} masks (caches of several lengths, sliding windows) are not supported")
        (self.mask_input, self.cache_len), = masks
        self.caches = [[int(v) for v in row] for row in constants[f"{prefix}_kv_cache_specs"].tolist()]
        named = [0, self.cos_input, self.sin_input, self.mask_input] + [row[i] for row in self.caches for i in (0, 2)]
        # The one input the specs leave unnamed, after all the others: the last real token's index.
        self.last_valid_input = max(named) + 1
        self.n_inputs = self.last_valid_input + 1


class StaticSession:
    """One sequence over a static program. `call(method, inputs) -> outputs` runs a method on its flat inputs and
    returns its flat outputs (the .pte's methods on the runtime, or the same module in PyTorch); `constants` are the
    program's constant methods' values. every_position: `call` returns every position's logits [1, T, vocab] when
    the last input is None (the module in PyTorch; a program returns its last real token's only)."""

    def __init__(self, call: Callable[[str, list], Sequence[torch.Tensor]], constants: dict,
                 every_position: bool = False):
        self.call, self.every_position = call, every_position
        self.layouts = {method: MethodLayout(constants, prefix) for method, prefix in METADATA_PREFIX.items()}
        self.prefill_len = self.layouts[PREFILL].input_len
        self.freqs_cos, self.freqs_sin = constants["freqs_cos"], constants["freqs_sin"]
        self.dtype = self.freqs_cos.dtype
        self.context = self.freqs_cos.shape[0]
        decode = self.layouts[DECODE]
        self.cache_len, self.n_layers = decode.cache_len, len(decode.caches)
        self.cache_shape = (1, int(constants["n_heads_per_cache"]), self.cache_len, int(constants["head_dim"]))
        self.k = [torch.zeros(self.cache_shape, dtype=self.dtype) for _ in range(self.n_layers)]
        self.v = [torch.zeros(self.cache_shape, dtype=self.dtype) for _ in range(self.n_layers)]
        self.position = 0
        self.stop_ids: tuple[int, ...] = tuple(int(i) for i in constants.get("get_eos_ids", ()))

    def reset(self) -> None:
        # Slots past the position are masked, so zeroing only keeps runs reproducible.
        for cache in (*self.k, *self.v):
            cache.zero_()
        self.position = 0

    def _rope_rows(self, table: torch.Tensor, start: int, width: int) -> torch.Tensor:
        rows = torch.zeros((width, table.shape[1]), dtype=table.dtype)  # padding past the context: never read
        real = table[start:start + width]
        rows[:len(real)] = real
        return rows

    def _run(self, method: str, tokens: list[int], every_position: bool = False) -> torch.Tensor:
        """Runs `tokens` (at most the method's input length, padded to it) at the current position; the logits of
        the last one [vocab], or of each [len(tokens), vocab]."""
        layout, start, valid = self.layouts[method], self.position, len(tokens)
        width = layout.input_len
        if start + valid > self.context:
            raise ValueError(f"{start + valid} tokens exceed the program's context of {self.context}")
        ids = torch.zeros((1, width), dtype=torch.int32)
        ids[0, :valid] = torch.tensor(tokens, dtype=torch.int32)
        inputs: list = [None] * layout.n_inputs
        inputs[0] = ids
        inputs[layout.mask_input] = causal_mask(start, width, layout.cache_len, self.dtype)
        inputs[layout.cos_input] = self._rope_rows(self.freqs_cos, start, width)
        inputs[layout.sin_input] = self._rope_rows(self.freqs_sin, start, width)
        for (k_in, _, v_in, _, _), k, v in zip(layout.caches, self.k, self.v):
            inputs[k_in], inputs[v_in] = k, v
        inputs[layout.last_valid_input] = None if every_position else torch.tensor([valid - 1], dtype=torch.long)
        outputs = self.call(method, inputs)
        logits = outputs[0][0, :valid] if every_position else outputs[0].reshape(-1, outputs[0].shape[-1])[-1]
        stored = min(valid, self.cache_len - start)  # the last position's K/V has no slot and no reader
        for (_, k_out, _, v_out, _), k, v in zip(layout.caches, self.k, self.v):
            k[:, :, start:start + stored] = outputs[k_out][:, :, :stored]
            v[:, :, start:start + stored] = outputs[v_out][:, :, :stored]
        self.position += valid
        return logits.clone()

    def feed(self, tokens: list[int]) -> torch.Tensor:
        """logits[vocab] of the last of `tokens`, appended at the current position: one token by `forward`, more by
        `prefill` chunks."""
        if len(tokens) == 1:
            return self._run(DECODE, tokens)
        for i in range(0, len(tokens), self.prefill_len):
            logits = self._run(PREFILL, tokens[i:i + self.prefill_len])
        return logits

    def _continue_at(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> list[int]:
        start = int(input_pos[0])
        if start == 0:
            self.reset()
        if start != self.position:
            raise ValueError(f"the session is at position {self.position}, not {start}")
        return tokens[0].tolist()

    def last_step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """step's interface for a generation loop, which reads the last position's logits only: [1, 1, vocab], the
        tokens fed as `feed` does (a prompt by `prefill` chunks)."""
        return self.feed(self._continue_at(tokens, input_pos))[None, None]

    def step(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """The dynamic program's interface, step(tokens[1, T], input_pos[1]) -> logits[1, T, vocab], for every
        position: by `prefill` chunks where `call` gives every position's logits, else one `forward` call a token,
        since a program's call returns its last real token's only. A call at position 0 starts a new sequence."""
        ids = self._continue_at(tokens, input_pos)
        if not self.every_position:
            return torch.stack([self.feed([token]) for token in ids])[None]
        chunks = [ids[i:i + self.prefill_len] for i in range(0, len(ids), self.prefill_len)]
        return torch.cat([self._run(PREFILL if len(chunk) > 1 else DECODE, chunk, every_position=True)
                          for chunk in chunks])[None]


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
    next_id = pick(session.feed(list(prompt_ids)), temperature, generator)
    prefill_s = time.perf_counter() - started
    out = [next_id]
    started = time.perf_counter()
    while next_id not in stop_ids and len(out) < max_new_tokens:
        if on_token:
            on_token(next_id)
        next_id = pick(session.feed([next_id]), temperature, generator)
        out.append(next_id)
    if on_token and next_id not in stop_ids:
        on_token(next_id)
    decode_s = time.perf_counter() - started
    return {"tokens": out, "prefill_tokens_per_s": len(prompt_ids) / prefill_s if prefill_s else 0.0,
            "decode_tokens_per_s": (len(out) - 1) / decode_s if decode_s and len(out) > 1 else 0.0}


def load_program(pte: Path):
    """(the runtime's program, its prefill and forward methods, its constants). Importing ExecuTorch's LLM custom
    ops and quantized kernels first lets a .pte that uses them load (they are absent from some installs)."""
    for name in ("executorch.extension.llm.custom_ops.custom_ops", "executorch.kernels.quantized"):
        try:
            __import__(name)
        except ImportError:
            pass
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte))
    missing = [name for name in STATIC_METADATA if name not in program.method_names]
    if missing:
        raise SystemExit(f"{pte} is not a static-shape program (no {', '.join(missing)}); "
                         "run it with ExecuTorch's TextLLMRunner instead.")
    constants = {}
    for name in (*STATIC_METADATA, "get_eos_ids"):
        if name in program.method_names:
            values = program.load_method(name).execute([])
            constants[name] = values if name == "get_eos_ids" else values[0]
    methods = {name: program.load_method(name) for name in (PREFILL, DECODE)}
    return program, methods, constants


def runtime_session(pte: Path) -> StaticSession:
    program, methods, constants = load_program(pte)

    def call(method: str, inputs: list) -> Sequence[torch.Tensor]:
        return methods[method].execute(inputs)

    call.program = program  # the methods borrow from the program: keep it alive with them
    return StaticSession(call, constants)


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
