"""Token-by-token generation over the KV cache, the same loop for the ExecuTorch runtime and for
eager PyTorch. Every Generation says which engine produced it."""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from models.errors import UserFacingError
from models.prompting import prompt_token_ids, stop_token_ids
from recipes.process import thread_policy
from recipes.files.pte_program import data_file_of, delegate_ids
from recipes.registry import backend_for_delegate
from recipes.output.report import Generation

# Engines, as they appear in reports and the UI.
ENGINE_RUNTIME = "executorch-runtime"
ENGINE_EAGER_FP32 = "eager-fp32"
ENGINE_EAGER_QUANTIZED = "eager-quantized"

DEFAULT_PROMPT = "What is the capital of France?"


_NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)


def pick_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        if logits.dtype in _NUMPY_FLOATS:
            # numpy's argmax runs on this thread alone; torch's starts its intra-op threads, which meet the
            # runtime's spinning worker: 21 µs more per decode step, 0.8 % of a step of the built-in model.
            return int(logits.detach().numpy().argmax())
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        return int(order[torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at temperature 0, else sampled from the top_p nucleus with a seeded
    generator, so a job's generations are reproducible."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


def generate(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    engine: str,
    tokenizer,
    prompt: str,
    max_new_tokens: int,
    max_seq_len: int,
    sampling: Sampling = Sampling(),
    stop_ids=(),
) -> Generation:
    """`step(tokens[1, T], input_pos[1]) -> logits[1, T, vocab]` runs the model and advances its cache. The
    logits need only last until the next call (the runtime's step lends its output buffer), and the step must
    not keep the input tensors: the loop writes the next token and position into the same two."""
    ids = prompt_token_ids(tokenizer, prompt)
    if len(ids) + max_new_tokens > max_seq_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max new tokens ({max_new_tokens}) exceeds the context of "
            f"{max_seq_len}; shorten the prompt, lower max new tokens or raise max context."
        )
    stops = stop_token_ids(tokenizer, stop_ids)
    temperature, top_p = sampling.temperature, sampling.top_p
    generator = torch.Generator().manual_seed(sampling.seed)
    start = time.perf_counter()
    logits = step(torch.tensor([ids], dtype=torch.long), torch.tensor([0], dtype=torch.long))
    prefill_s = time.perf_counter() - start
    next_id = pick_next(logits[0, -1], temperature, top_p, generator)
    out: list[int] = []
    pos = len(ids)
    # One token and one position tensor for every step, written through numpy views: two new tensors per step
    # cost ~4 µs of the calling thread, while the runtime's worker waits.
    token, position = torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long)
    token_slot, position_slot = token.numpy(), position.numpy()
    start = time.perf_counter()
    while True:
        out.append(next_id)
        if next_id in stops or len(out) >= max_new_tokens:
            break
        token_slot[0, 0], position_slot[0] = next_id, pos
        logits = step(token, position)
        pos += 1
        next_id = pick_next(logits[0, -1], temperature, top_p, generator)
    decode_s = time.perf_counter() - start
    decoded_steps = len(out) - 1  # the first new token came from prefill
    text = tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=True)
    return Generation(
        engine=engine,
        prompt=prompt,
        text=text.strip(),
        prompt_tokens=len(ids),
        new_tokens=len(out),
        prefill_tokens_per_s=round(len(ids) / prefill_s, 2) if prefill_s > 0 else 0.0,
        decode_tokens_per_s=round(decoded_steps / decode_s, 2) if decode_s > 0 and decoded_steps else 0.0,
        tokens=out,
    )


def eager_step(module: torch.nn.Module) -> Callable:
    # Stale cache rows never matter (every attention path masks positions >= the current one),
    # but a fresh start keeps runs reproducible where the module allows it.
    if hasattr(module, "reset_cache"):
        module.reset_cache()

    per_call = _static_tokens_per_call(module)

    def step(tokens, input_pos):
        with torch.no_grad():
            if per_call == 1 and tokens.shape[1] > 1:  # a one-token static program: prefill token by token
                return torch.cat([module(tokens[:, i:i + 1], input_pos + i) for i in range(tokens.shape[1])], dim=1)
            return module(tokens, input_pos)

    return step


def _static_tokens_per_call(module: torch.nn.Module) -> int | None:
    """The fixed token count of a program exported with static shapes (Backend.static_tokens, via
    program.module()), or None when the module takes any number of tokens."""
    if not isinstance(module, torch.fx.GraphModule):
        return None
    tokens = next((n for n in module.graph.nodes if n.op == "placeholder"), None)
    value = tokens.meta.get("val") if tokens is not None else None
    size = value.shape[1] if isinstance(value, torch.Tensor) and value.dim() == 2 else None
    return size if isinstance(size, int) else None


def load_runtime_method(pte: Path | bytes, runtime_imports: tuple[str, ...] = ()):
    """Loads the .pte's forward method on the ExecuTorch runtime, with the .ptd beside it when there is one. Ops
    outside delegates resolve at load_method time, so the kernel libraries the recipe needs are imported first."""
    for name in runtime_imports:
        importlib.import_module(name)
    from executorch.runtime import Runtime

    runtime = Runtime.get()
    ptd = data_file_of(pte)
    program = runtime.load_program(pte if isinstance(pte, bytes) else str(pte),
                                   data_path=str(ptd) if ptd is not None else None)
    try:
        method = program.load_method("forward")
    except RuntimeError as err:
        missing = [b for b in delegate_backends(pte) if not runtime.backend_registry.is_available(b)]
        if missing:
            where = "; ".join(f"{b} programs run on {_runs_on(b)}" for b in missing)
            raise UserFacingError(
                f"this .pte delegates to {', '.join(missing)}, which this ExecuTorch runtime does not have "
                f"(it has {', '.join(runtime.backend_registry.registered_backend_names) or 'none'}); {where}."
            ) from err
        raise
    # The method borrows from the program: keep both alive together or execute() reads freed memory.
    return program, method


def _runs_on(delegate_id: str) -> str:
    """Where a delegate's programs run, from the registered backend of that delegate id."""
    backend = backend_for_delegate(delegate_id)
    return backend.runs_on if backend is not None else "a runtime built with that backend"


def delegate_backends(pte: Path | bytes) -> list[str]:
    """Backend ids of the delegates in a .pte, read from its flatbuffer."""
    return delegate_ids(pte)


def runtime_step(loaded, warm: bool = True) -> Callable:
    """The .pte's forward as a step. Its logits are the runtime's own output buffer, valid until the next call.
    `Method.execute` copies them out: 7.3 MB for a 37-token prefill, 0.2 ms, and with the loop's reused inputs
    9 µs of each decode step (22.5 -> 13.4 µs of loop on a program that only looks up logits). Callers that
    keep logits across calls copy them (recipes/evaluation/fidelity.py does).

    warm: the step makes its first call here, as part of loading (see `warm_up`)."""
    _program, method = loaded
    call = _borrowing_call(method)
    most = tokens_per_call(method)

    def step(tokens, input_pos):
        with thread_policy.runtime_threads():
            if most is None or tokens.shape[1] <= most:
                return call([tokens, input_pos])[0]
            # More tokens than one call takes: calls of `most`, chained through the cache, as ExecuTorch's LLM
            # runner prefills; each call's logits are copied out before the next call reuses the buffer.
            logits = None
            for first in range(0, tokens.shape[1], most):
                piece = call([tokens[:, first:first + most], input_pos + first])[0]
                if logits is None:
                    logits = torch.empty((1, tokens.shape[1], piece.shape[-1]), dtype=piece.dtype)
                logits[:, first:first + piece.shape[1]] = piece
            return logits

    # The method borrows from the program (and a program loaded from bytes from those bytes): the step keeps both,
    # so a caller may hold only the step. Without this a step over a .pte loaded from bytes segfaulted once the
    # bytes were collected.
    step.loaded = loaded
    if warm:
        warm_up(step)
    return step


def tokens_per_call(method) -> int | None:
    """The most tokens the program's forward takes in one call: its token input's largest shape, which the
    program records (for a dynamic dimension, its upper bound). None for a method without that record."""
    metadata = getattr(method, "metadata", None)
    return int(metadata.input_tensor_meta(0).sizes()[1]) if metadata is not None else None


def warm_up(step: Callable) -> None:
    """One decode-shaped call (token 0 at position 0), made when a program is loaded so that a generation
    measures the program and not its one-time setup. On its first call a delegate may plan its workspace
    for the longest sequence it accepts and zero it, which would otherwise land in the first prefill
    (docs/design.md, "Warm-up"). ExecuTorch's LLM runner and llama.cpp's tools warm up the same way. The
    cache row it writes is harmless: a generation's prefill starts at position 0 and rewrites it, and
    attention never reads a row past the current position."""
    step(torch.zeros((1, 1), dtype=torch.long), torch.zeros((1,), dtype=torch.long))


def _borrowing_call(method) -> Callable:
    """`method.execute` without its copy of the outputs. executorch.runtime's `Method.execute` passes
    only the inputs to its pybind method, whose `clone_outputs` (executorch 1.5.1) is what copies."""
    bound = getattr(method, "_method", None)
    # pybind11 writes each overload's signature into __doc__: the flag is used only where it is declared, so
    # another executorch keeps its own execute, copies and all.
    if bound is None or "clone_outputs" not in (type(bound).__call__.__doc__ or ""):
        return method.execute

    def call(inputs):
        return bound(inputs, clone_outputs=False)

    return call
