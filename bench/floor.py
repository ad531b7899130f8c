"""What XNNPACK's kernels allow on the machine it runs on: the least a decode step's delegated part can cost.
Prints one JSON line.

    python -m bench.floor [--rounds 30] [--threads 2]

It lowers small probe programs with Lowerbench's own functions (the same quantizer, partitioner and
lowering as xnnpack-8da4w) and times them on the ExecuTorch runtime, one token at a time, in turn:
- 400 chained 576x576 int4 g32 linears against 4 linears 576x57600 with the same weight bytes (74.6 MB,
  twice the L3 of the machines this runs on). The big ones give the rate at which XNNPACK's int4 kernel
  streams weights; the difference per linear is what every linear costs on top (dynamic quantization of
  its input, the thread pool's start and join).
- the same pair at 7.5 MB, which stays in the L3 cache, for comparison;
- 400 chained elementwise ops against 1: what one small op inside a delegate costs;
- 200 chained RMSNorms, Lowerbench's (its mean of squares as a linear) and with XNNPACK's mean instead;
- the attention ops a decode step runs outside the delegate, for all 30 layers (llama::update_cache twice
  and llama::custom_sdpa, Lowerbench's own Attention methods on the built-in model's caches), at the
  positions the decode phase reaches: once with the caches warm in the L3 cache, once right after the
  74.6 MB probe has streamed its weights through it, as the layers before them do in a real step.
With the counts of a real program (bench/breakdown.py records them) these give its delegated part's
floor: weight bytes ÷ streaming rate + quantized linears × cost per linear + other ops × cost per op."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from recipes.process import thread_policy

# Timed like every Lowerbench runtime call (thread_policy.py), set before torch loads.
if __name__ == "__main__":
    thread_policy.limit_openmp_default()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.decode import MAX_SEQ_LEN, set_runtime_threads  # noqa: E402  (MAX_SEQ_LEN: the context the benchmark exports with)
from bench.memory import INT4_G32_BYTES_PER_WEIGHT  # noqa: E402
from models.attention import form_for  # noqa: E402
from models.llama import ExportOptions, LlamaShape, RMSNorm  # noqa: E402
from quant.schemes import quantize_linears_8da4w  # noqa: E402
from recipes.backends.xnnpack import BACKEND, xnnpack_partitioners  # noqa: E402
from recipes.running.generate import load_runtime_method  # noqa: E402
from recipes.lowering.lower import Lowering, lower_to_pte  # noqa: E402
from recipes.output.report import Delegation  # noqa: E402


HIDDEN = 576  # SmolLM2-135M's hidden size, so the probes' linears have its shapes
GROUP = 32
# SmolLM2-135M's attention: 30 layers of 9 query and 3 KV heads of 64 (9 x 64 = HIDDEN)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
# The positions bench/decode.py's steps attend from: its 37-token prompt, then 64 new tokens
DECODE_POSITIONS = range(37, 37 + 64)
CHAIN = 400
NORMS = 200


class _Elementwise(nn.Module):
    def __init__(self, ops: int):
        super().__init__()
        self.ops = ops

    def forward(self, x):
        for i in range(self.ops):
            x = x * 1.0001 if i % 2 else x + 0.0001
        return x


class _LinearChain(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(count))

    def forward(self, x):
        for linear in self.linears:
            x = linear(x)
        return x


class _WideLinears(nn.Module):
    def __init__(self, count: int, out_features: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(HIDDEN, out_features, bias=False) for _ in range(count))

    def forward(self, x):
        return tuple(linear(x) for linear in self.linears)


class _Norms(nn.Module):
    """Chained RMSNorms over the hidden size: Lowerbench's own (models/llama.py, its mean of squares as a linear)
    or with XNNPACK's mean over a 4-D view, the form it replaced."""

    def __init__(self, count: int, xnnpack_mean: bool):
        super().__init__()

        self.norms = nn.ModuleList(RMSNorm(HIDDEN, 1e-5, form="linear-mean") for _ in range(count))
        self.xnnpack_mean = xnnpack_mean

    def forward(self, x):
        for norm in self.norms:
            if self.xnnpack_mean:
                variance = (x * x).unsqueeze(-1).mean(dim=(-2, -1), keepdim=True).view(1, -1, 1)
                x = norm.weight * (x * torch.rsqrt(variance + norm.eps))
            else:
                x = norm(x)
        return x


class CacheAttention(nn.Module):
    """A decode step's work outside the XNNPACK delegate, layer after layer: the cache writes and custom_sdpa
    of the custom-ops attention form (models/attention/executorch_ops.py, its own methods), chained over the layers."""

    def __init__(self, shape, options):
        super().__init__()
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (registers the llama:: ops)

        self.context = options.max_seq_len
        self.layers = nn.ModuleList(form_for(options)(shape, options) for _ in range(shape.n_layers))
        for layer in self.layers:  # the probe calls only the cache methods: no projection weights in its program
            del layer.qkv_proj, layer.o_proj

    def forward(self, q, k, v, input_pos):
        start_pos = input_pos[0].item()
        torch._check(start_pos >= 0)
        torch._check(start_pos + q.shape[1] <= self.context)
        for layer in self.layers:
            layer.write_cache(k, v, start_pos)
            q = layer.attend_cache(q, start_pos)  # chained, so every layer's sdpa stays in the program
        return q


def _builtin_attention() -> CacheAttention:
    """The probe on caches shaped as in the built-in model."""
    shape = LlamaShape(vocab_size=1, hidden=HIDDEN, intermediate=1, n_layers=LAYERS, n_heads=HEADS,
                       n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5, attention_bias=False,
                       mlp_bias=False, max_position_embeddings=MAX_SEQ_LEN)
    return CacheAttention(shape, ExportOptions(max_seq_len=MAX_SEQ_LEN, attention="custom", fuse_qkv=True))


def _lower_attention():
    """The attention probe through Lowerbench's lowering with XNNPACK's partitioners: nothing in it is
    delegable, so it runs on ExecuTorch's kernels as in the real program."""
    example = (torch.randn(1, 1, HEADS, HEAD_DIM), torch.randn(1, 1, KV_HEADS, HEAD_DIM),
               torch.randn(1, 1, KV_HEADS, HEAD_DIM), torch.tensor([DECODE_POSITIONS[0]]))
    with torch.no_grad():
        program = torch.export.export(_builtin_attention().eval(), example, strict=False)
    lowered = lower_to_pte(program, xnnpack_partitioners({}), Lowering(lowering_context=BACKEND.lowering_context))
    return load_runtime_method(lowered.pte, BACKEND.runtime_imports)


def _time_attention(attention, streamer, x) -> tuple[float, float]:
    """ms per decode step of the attention probe, walking the decode positions: (caches warm in L3, right
    after the streaming probe's weights went through the cache). Each call is timed on its own."""
    q, k, v = torch.randn(1, 1, HEADS, HEAD_DIM), torch.randn(1, 1, KV_HEADS, HEAD_DIM), torch.randn(1, 1, KV_HEADS, HEAD_DIM)
    warm, cold = [], []
    for pos in DECODE_POSITIONS:
        inputs = [q, k, v, torch.tensor([pos])]
        attention.execute(inputs)  # writes this position's rows, as the step before would have
        start = time.perf_counter()
        attention.execute(inputs)
        warm.append(time.perf_counter() - start)
        streamer.execute([x])
        start = time.perf_counter()
        attention.execute(inputs)
        cold.append(time.perf_counter() - start)
    return statistics.median(warm) * 1e3, statistics.median(cold) * 1e3


def _weight_bytes(module: nn.Module) -> int:
    return int(sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear)) * INT4_G32_BYTES_PER_WEIGHT)


def _lower(module: nn.Module, quantize: bool):
    """module -> loaded runtime method, through the xnnpack-8da4w path: dynamic token dimension, as the
    real program has (so XNNPACK reshapes on every call there too)."""
    module.eval()
    if quantize:
        quantize_linears_8da4w(module, GROUP)
    tokens = torch.export.Dim("seq_len", min=1, max=MAX_SEQ_LEN)
    with torch.no_grad():
        program = torch.export.export(module, (torch.randn(1, 2, HIDDEN),), dynamic_shapes=({1: tokens},), strict=False)
    lowered = lower_to_pte(program, xnnpack_partitioners({}), Lowering(lowering_context=BACKEND.lowering_context))
    if lowered.delegation.non_delegated_nodes > len(program.graph_signature.user_outputs) + 1:
        raise RuntimeError(f"probe {type(module).__name__} left work outside XNNPACK: {lowered.delegation}")
    return load_runtime_method(lowered.pte)


def probes() -> dict[str, tuple[nn.Module, bool]]:
    torch.manual_seed(0)
    return {
        "chain_big": (_LinearChain(CHAIN), True),
        "wide_big": (_WideLinears(4, CHAIN * HIDDEN // 4), True),
        "chain_l3": (_LinearChain(CHAIN // 10), True),
        "wide_l3": (_WideLinears(4, CHAIN * HIDDEN // 40), True),
        "ops_1": (_Elementwise(1), False),
        "ops_many": (_Elementwise(CHAIN + 1), False),
        "norms_linear": (_Norms(NORMS, xnnpack_mean=False), False),
        "norms_mean": (_Norms(NORMS, xnnpack_mean=True), False),
    }


def measure(rounds: int, threads: int, calls: int = 20) -> dict:
    set_runtime_threads(threads)
    built = probes()
    weight_bytes = {name: _weight_bytes(module) for name, (module, _) in built.items()}
    methods = {name: _lower(module, quantize) for name, (module, quantize) in built.items()}
    _attention_program, attention = _lower_attention()
    x = torch.randn(1, 1, HIDDEN) * 0.01
    ms = {name: [] for name in methods}
    for i in range(rounds + 1):  # round 0 warms caches and the thread pool; it is not counted
        for name, (_program, method) in methods.items() if i % 2 else list(methods.items())[::-1]:
            with thread_policy.runtime_threads():
                method.execute([x])
                start = time.perf_counter()
                for _ in range(calls):
                    method.execute([x])
                elapsed = time.perf_counter() - start
            if i:
                ms[name].append(elapsed / calls * 1e3)
        with thread_policy.runtime_threads():
            warm, cold = _time_attention(attention, methods["wide_big"][1], x)
        if i:
            ms.setdefault("attention_warm", []).append(warm)
            ms.setdefault("attention_cold", []).append(cold)
    med = {name: statistics.median(values) for name, values in ms.items()}
    linears_big, linears_l3 = CHAIN - 4, CHAIN // 10 - 4
    return {
        "threads": threads, "rounds": rounds, "ms_per_call": {k: round(v, 4) for k, v in med.items()},
        "weight_mb": {k: round(v / 1e6, 2) for k, v in weight_bytes.items() if v},
        # Same bytes, CHAIN linears against 4: the difference is the cost of the extra linears.
        "us_per_linear": round((med["chain_big"] - med["wide_big"]) * 1e3 / linears_big, 3),
        "us_per_linear_in_l3": round((med["chain_l3"] - med["wide_l3"]) * 1e3 / linears_l3, 3),
        "stream_gb_per_s": round(weight_bytes["wide_big"] / med["wide_big"] / 1e6, 2),
        "l3_gb_per_s": round(weight_bytes["wide_l3"] / med["wide_l3"] / 1e6, 2),
        "us_per_op": round((med["ops_many"] - med["ops_1"]) * 1e3 / CHAIN, 4),
        "us_per_norm": round((med["norms_linear"] - med["ops_1"]) * 1e3 / NORMS, 3),
        "us_per_norm_with_xnnpack_mean": round((med["norms_mean"] - med["ops_1"]) * 1e3 / NORMS, 3),
        # custom_sdpa + 2 update_cache for all layers, per step (one runtime call each, its overhead included)
        "attention_ms_warm": round(med["attention_warm"], 4),
        "attention_ms_after_weights": round(med["attention_cold"], 4),
        "attention_positions": [DECODE_POSITIONS[0], DECODE_POSITIONS[-1]],
    }


def delegated_work(delegation: Delegation) -> dict:
    """A lowered program's delegated work per call, from its delegation table (recipes/lowering/delegation.py).
    torchao quantizes each linear's input on its own, so there is one choose_qparams per quantized linear.
    Its weights' dequantize folds into the linear and the input's choose_qparams + quantize + dequantize into
    one convert, which the probes' cost per linear includes. Every other op, an fp32 linear too, counts at
    the cost of a small elementwise op, so the floor stays a lower bound."""
    delegated = {row.op: row.delegated for row in delegation.ops}
    quantized = delegated.get("torchao_choose_qparams_affine_default", 0)
    folded = sum(delegated.get(op, 0) for op in ("getitem", "torchao_dequantize_affine_default",
                                                 "torchao_choose_qparams_affine_default",
                                                 "torchao_quantize_affine_default"))
    return {"quantized_linears": quantized, "other_ops": delegation.delegated_nodes - folded - quantized}


def floor_ms(costs: dict, weight_bytes: int, work: dict) -> float:
    """The least the delegated part of a step can cost with these kernels."""
    return (weight_bytes / (costs["stream_gb_per_s"] * 1e6) + work["quantized_linears"] * costs["us_per_linear"] / 1e3
            + work["other_ops"] * costs["us_per_op"] / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.rounds, args.threads)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
