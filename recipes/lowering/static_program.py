"""A static-shape recipe's programs: the quantized LlamaForExport in its static form (models/static_llama.py),
exported twice with fixed shapes, `prefill` (a chunk of tokens) and `decode` (one token), to be lowered together
into one .pte; the constant methods its runner reads; and sessions that drive it (recipes/running/static_runner.py, which
ships beside the .pte as run_static.py) on the runtime or, where the .pte cannot run, the same module in PyTorch."""
from __future__ import annotations

from pathlib import Path

import torch

from models import torch_export
from models.static_llama import StaticLlama
from recipes.running import static_runner

PREFILL, DECODE = static_runner.PREFILL, static_runner.DECODE
RUNNER_NAME = "run_static.py"
RUNNER_NOTE = ("ExecuTorch's TextLLMRunner (C++, behind llama_main and the demo apps) cannot drive this program: "
               "it expects one `forward` method keeping its KV cache as state, while this one has `prefill` and "
               "`decode` methods with the caches and masks as inputs and outputs; run_static.py in this folder "
               "drives it on the ExecuTorch runtime's Python API")


def runner_note(cannot_run_here: str | None) -> str:
    """The report's runner_note: why ExecuTorch's runner is absent, and, where the .pte cannot run here, that it
    was lowered and inspected, not run."""
    if cannot_run_here is None:
        return RUNNER_NOTE
    return (f"{RUNNER_NOTE}. This program was lowered and inspected here (delegation, shapes, metadata), not run: "
            f"{cannot_run_here}")


PROFILE_NOTE = "the per-op profile reads a `forward` method; this static program has `prefill` and `decode`"


def static_form(module: torch.nn.Module, options: dict) -> StaticLlama:
    """The static form of a built (and quantized) LlamaForExport, its wide linears split by the recipe's
    max_linear_outputs (row slices of the same weights, so a module another recipe shares computes the same)."""
    if isinstance(module, StaticLlama):
        return module
    return StaticLlama(module, max_outputs=options.get("max_linear_outputs"))


def export_methods(static: StaticLlama, prefill_len: int, strict: bool = True) -> dict[str, torch.export.ExportedProgram]:
    """{"prefill": a prefill_len-token program, "decode": a one-token program}, every shape static."""
    if not 1 < prefill_len <= static.context:
        raise ValueError(f"prefill_chunk must be between 2 and the context ({static.context}), got {prefill_len}")
    return {name: torch_export.export(static, static.example_inputs(tokens), strict=strict)
            for name, tokens in ((static_runner.PREFILL, prefill_len), (static_runner.DECODE, 1))}


def static_metadata(static: StaticLlama, prefill_len: int) -> dict:
    """The constant methods run_static.py reads (static_runner.STATIC_METADATA)."""
    return {"get_prefill_len": int(prefill_len), "get_decode_len": 1,
            "get_kv_cache_shape": [int(d) for d in static.cache_shape],
            "get_kv_cache_fp16": static.dtype == torch.float16}


def eager_session(static: StaticLlama, prefill_len: int) -> static_runner.StaticSession:
    """The static module in PyTorch behind the runner's own session: the same chunks, masks and cache writes."""
    n_layers = static.llama.shape.n_layers

    def call(method: str, inputs: list):
        tokens, input_pos, mask = inputs[:3]
        with torch.no_grad():
            logits, k_new, v_new = static(tokens, input_pos, mask, inputs[3:3 + n_layers], inputs[3 + n_layers:])
        return [logits, *k_new, *v_new]

    return static_runner.StaticSession(call, prefill_len, n_layers, static.cache_shape, static.dtype)


def runtime_session(pte: Path) -> static_runner.StaticSession:
    return static_runner.runtime_session(pte)


def runner_source() -> bytes:
    """run_static.py as shipped: the runner module's own source."""
    return Path(static_runner.__file__).read_bytes()
