"""A program of KV-I/O methods (models/kv_io_llama.py): one module exported for a prefill of N tokens per call and for
one-token decode, PT2E-quantized with one calibration for both (quant/pt2e_methods.py), the constant methods its
runner reads, and the simulation that drives the converted methods as that runner does
(recipes/running/kv_io_session.py). The backend names the methods (Backend.kv_io_methods)."""
from __future__ import annotations

from typing import Callable

import torch

from models import torch_export
from models.kv_io_llama import KvIoLlama
from quant.pt2e_methods import quantize_pt2e_methods
from recipes.running.kv_io_session import KvIoSession, KvIoSimulation


def kv_io_form(module: torch.nn.Module) -> KvIoLlama:
    return module if isinstance(module, KvIoLlama) else KvIoLlama(module)


def export_methods(form: KvIoLlama, methods: dict[str, int], strict: bool) -> dict[str, torch.export.ExportedProgram]:
    """{method: the form exported for that many tokens per call}, every shape static."""
    for name, tokens in methods.items():
        if not 1 <= tokens < form.context:
            raise ValueError(f"{name} takes {tokens} tokens per call; it must be between 1 and the context "
                             f"({form.context}) less one")
    return {name: torch_export.export(form, form.example_inputs(tokens), strict=strict)
            for name, tokens in methods.items()}


def session(form: KvIoLlama, methods: dict[str, int], call: Callable | None = None) -> KvIoSession:
    (prefill, prefill_len), (decode, _) = methods.items()
    shape = form.shape
    return KvIoSession(call, prefill, decode, prefill_len, shape.n_layers, shape.n_kv_heads, shape.head_dim,
                       form.context, form.dtype)


def quantize_methods(form: KvIoLlama, programs: dict, methods: dict[str, int], calibration: list,
                     quantizer_for: Callable):
    """({method: quantized program}, the simulation of them): calibrated through the prefill method (the first),
    each calibration prompt prefilled from position 0 as the runner would."""
    prefill = next(iter(methods))

    def calibrate(prepared: torch.nn.Module) -> None:
        driver = session(form, methods, lambda method, inputs: list(prepared(*inputs)))
        for tokens, _ in calibration:
            driver.reset()
            driver.prefill(tokens[0].tolist()[:form.context - methods[prefill]])

    quantized, converted = quantize_pt2e_methods(programs, quantizer_for, calibrate, prefill)
    return quantized, KvIoSimulation(converted, session(form, methods), form.shape)


def kv_io_metadata(simulation: KvIoSimulation, methods: dict[str, int], config, tokenizer, eos_token_ids) -> dict:
    """The constant methods of Qualcomm's static Llama export (examples/qualcomm/oss_scripts/llama/model/
    static_llama.py, get_metadata of its one-token program), whose runner reads get_n_layers and the shapes of
    the methods' inputs and outputs; the KV caches are float inputs and outputs (kv_io_bit_width 32)."""
    shape, context = simulation.shape, simulation.session.context
    bos = tokenizer.bos_token_id if isinstance(tokenizer.bos_token_id, int) else getattr(config, "bos_token_id", None)
    eos = sorted(int(i) for i in eos_token_ids or ())
    return {
        "get_ar_len": int(list(methods.values())[-1]),
        "get_bos_id": int(bos) if isinstance(bos, int) else -1,
        "get_eos_id": eos[0] if eos else -1,
        "get_dim": int(shape.hidden),
        "get_head_dim": int(shape.head_dim),
        "get_max_batch_size": 1,
        "get_max_seq_len": int(context),
        "get_max_context_len": int(context),
        "get_n_bos": 1,
        "get_n_eos": 1,
        "get_n_kv_heads": int(shape.n_kv_heads),
        "get_n_layers": int(shape.n_layers),
        "get_vocab_size": int(shape.vocab_size),
        "get_use_kv_cache": True,
        "get_kv_io_bit_width": 32,
    }
