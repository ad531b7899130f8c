"""A static-shape recipe's programs: the quantized LlamaForExport in its static form (models/static_llama.py),
exported twice with fixed shapes, `forward` (one token: decode) and `prefill` (a chunk of tokens), to be lowered
together into one .pte; the constant methods of ExecuTorch's own static Llama export, which its runners read
(docs/coreml.md); and sessions that drive it (recipes/running/static_runner.py, which ships beside the .pte as
run_static.py) on the runtime or, where the .pte cannot run, the same module in PyTorch."""
from __future__ import annotations

from pathlib import Path

import torch

from models import torch_export
from models.static_llama import (FIRST_CACHE_INPUT, FIRST_CACHE_OUTPUT, FREQS_COS_INPUT, FREQS_SIN_INPUT, MASK_INPUT,
                                 StaticLlama)
from recipes.running import static_runner

PREFILL, DECODE = static_runner.PREFILL, static_runner.DECODE
RUNNER_NAME = "run_static.py"
RUNNER_NOTE = ("ExecuTorch's TextLLMRunner (C++, behind llama_main and the demo apps) cannot drive this program: "
               "it expects one `forward` method keeping its KV cache as state, while this one, in the layout of "
               "ExecuTorch's static Llama export, takes the caches, masks and rope rows as inputs and outputs of its "
               "`forward` and `prefill` methods; run_static.py in this folder drives it on the ExecuTorch runtime's "
               "Python API, and ExecuTorch's C++ StaticAttentionIOManager on a device")


def runner_note(cannot_run_here: str | None) -> str:
    """The report's runner_note: why ExecuTorch's runner is absent, and, where the .pte cannot run here, that it
    was lowered and inspected, not run."""
    if cannot_run_here is None:
        return RUNNER_NOTE
    return (f"{RUNNER_NOTE}. This program was lowered and inspected here (delegation, shapes, metadata), not run: "
            f"{cannot_run_here}")


PROFILE_NOTE = ("the per-op profile drives a `forward` method that keeps its KV cache; this static program's `forward` "
                "and `prefill` take the caches as inputs")


def static_form(module: torch.nn.Module, options: dict) -> StaticLlama:
    """The static form of a built (and quantized) LlamaForExport, its wide linears split by the recipe's
    max_linear_outputs (row slices of the same weights, so a module another recipe shares computes the same)."""
    if isinstance(module, StaticLlama):
        return module
    return StaticLlama(module, max_outputs=options.get("max_linear_outputs"))


def export_methods(static: StaticLlama, prefill_len: int,
                   strict: bool = True) -> dict[str, torch.export.ExportedProgram]:
    """{"forward": a one-token program, "prefill": a prefill_len-token program}, every shape static, in the order of
    ExecuTorch's export (Core ML pairs the methods' partitions by position)."""
    if not 1 < prefill_len <= static.context:
        raise ValueError(f"prefill_chunk must be between 2 and the context ({static.context}), got {prefill_len}")
    return {name: torch_export.export(static, static.example_inputs(tokens), strict=strict)
            for name, tokens in ((DECODE, 1), (PREFILL, prefill_len))}


def _method_metadata(static: StaticLlama, prefix: str, input_len: int) -> dict:
    n_layers = static.llama.shape.n_layers
    cache_specs = [[FIRST_CACHE_INPUT + i, FIRST_CACHE_OUTPUT + i, FIRST_CACHE_INPUT + n_layers + i,
                    FIRST_CACHE_OUTPUT + n_layers + i, static.cache_len] for i in range(n_layers)]
    return {f"{prefix}_input_len": int(input_len),
            f"{prefix}_freqs_cos_input_index": torch.tensor([FREQS_COS_INPUT], dtype=torch.int64),
            f"{prefix}_freqs_sin_input_index": torch.tensor([FREQS_SIN_INPUT], dtype=torch.int64),
            f"{prefix}_mask_specs": torch.tensor([[MASK_INPUT, static.cache_len]], dtype=torch.int64),
            f"{prefix}_kv_cache_specs": torch.tensor(cache_specs, dtype=torch.int64)}


def static_metadata(static: StaticLlama, prefill_len: int) -> dict:
    """The constant methods of ExecuTorch's static Llama export (static_runner.STATIC_METADATA), with its names,
    types and values."""
    shape = static.llama.shape
    cos, sin = static.rope_tables()
    return {"vocab_size": int(shape.vocab_size), "head_dim": int(shape.head_dim),
            "n_heads_per_cache": int(shape.n_kv_heads), "freqs_cos": cos.clone(), "freqs_sin": sin.clone(),
            **_method_metadata(static, static_runner.METADATA_PREFIX[DECODE], 1),
            **_method_metadata(static, static_runner.METADATA_PREFIX[PREFILL], prefill_len)}


def reported_metadata(metadata: dict) -> dict:
    """The constant methods as the report keeps them: numbers and lists, without the tensors (rope tables, input
    specs), which the .pte holds."""
    return {name: value for name, value in metadata.items() if not isinstance(value, torch.Tensor)}


def eager_session(static: StaticLlama, prefill_len: int) -> static_runner.StaticSession:
    """The static module in PyTorch behind the runner's own session: the same chunks, masks and cache writes, laid
    out by the same constant methods; for fidelity, a chunk's every position's logits at once."""
    n_layers = static.llama.shape.n_layers
    caches = FIRST_CACHE_INPUT

    def call(method: str, inputs: list):
        with torch.no_grad():
            logits, k_new, v_new = static(*inputs[:caches], inputs[caches:caches + n_layers],
                                          inputs[caches + n_layers:caches + 2 * n_layers], inputs[-1])
        return [logits, *k_new, *v_new]

    return static_runner.StaticSession(call, static_metadata(static, prefill_len), every_position=True)


def runtime_session(pte: Path) -> static_runner.StaticSession:
    return static_runner.runtime_session(pte)


def runner_source() -> bytes:
    """run_static.py as shipped: the runner module's own source."""
    return Path(static_runner.__file__).read_bytes()
