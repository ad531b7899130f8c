"""One engine, one greedy generation of exactly N new tokens, in its own process; prints one JSON line.

    python -m bench.decode ENGINE [--pte FILE] [--gguf FILE] [--hf FOLDER] [--threads 2] [--new-tokens 64]

Engines: lowerbench-pte and optimum-pte (the .pte on executorch.runtime through recipes/running/generate.py's
loop), llama.cpp (llama-cpp-python on the GGUF), hf-eager (transformers generate, fp32).
Every engine gets the same prompt token ids (the chat template of the model's own tokenizer), and end
of sequence is ignored so each produces the same number of tokens. Every engine makes one one-token call
after loading, before the timed generation: the .pte engines in recipes/running/generate.py's runtime_step (what
Lowerbench does whenever it loads a program), llama.cpp and HF eager here. First calls set things up once
(XNNPACK plans its workspace, llama.cpp its compute buffers); llama.cpp's own tools and ExecuTorch's LLM
runner warm up the same way."""
from __future__ import annotations

import argparse
import json
import sys
import time

from recipes.process import thread_policy

# OpenMP reads its default when torch loads, so the policy (thread_policy.py) is applied here, before the
# import below. Both .pte engines run in a Lowerbench process: the same runtime loop for both. The other
# engines keep their own defaults. --stock-threads: Lowerbench's .pte without the policy, the baseline
# that shows what the policy buys.
if __name__ == "__main__" and sys.argv[1:2] in (["lowerbench-pte"], ["optimum-pte"]) and "--stock-threads" not in sys.argv:
    thread_policy.limit_openmp_default()

import torch  # noqa: E402

from recipes.running import generate as gen  # noqa: E402
from recipes.backends.xnnpack import BACKEND  # noqa: E402


MAX_SEQ_LEN = 512


class _NeverStops:
    """The tokenizer with no end-of-sequence token: generate() then always makes max_new_tokens."""

    eos_token_id = None

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def load_tokenizer(hf_folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_folder)


def set_runtime_threads(threads: int) -> None:
    """The runtime's thread pool at `threads`. Call it before loading any program: the reset replaces the
    pool, and XNNPACK delegates created earlier keep the old one. Reset after a program had run (the .pte
    engines' warm-up), 1 thread aborted with "double free or corruption" in 8 of 9 processes."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(threads)


def runtime_engine_step(pte: str, positions: str):
    """The .pte's forward on executorch.runtime as generate()'s step(tokens, input_pos[1]).
    positions="start": Lowerbench's forward(tokens, input_pos[1]); "all": optimum's
    forward(input_ids, cache_position[T]). Without the policy's OpenMP default (--stock-threads) the
    step's per-call thread setting does nothing, so the same step serves both."""
    step = gen.runtime_step(gen.load_runtime_method(pte, BACKEND.runtime_imports))
    if positions == "start":
        return step

    def all_positions(tokens, input_pos):
        start = int(input_pos[0])
        return step(tokens, torch.arange(start, start + tokens.shape[1], dtype=torch.long))

    return all_positions


def executorch_pte(pte: str, tokenizer, prompt: str, new_tokens: int, threads: int, positions: str) -> dict:
    set_runtime_threads(threads)
    step = runtime_engine_step(pte, positions)
    cpu = []
    timed = step

    def step(tokens, input_pos):
        start = time.process_time()
        logits = timed(tokens, input_pos)
        cpu.append(time.process_time() - start)
        return logits

    result = gen.generate(step, "executorch-runtime", _NeverStops(tokenizer), prompt, new_tokens, MAX_SEQ_LEN).to_dict()
    return {**result, **_cpu_rates(result["prompt_tokens"], result["new_tokens"], cpu[0], sum(cpu[1:]))}


def llama_cpp(gguf: str, tokenizer, prompt: str, new_tokens: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=MAX_SEQ_LEN, n_threads=threads, n_threads_batch=threads,
                n_batch=MAX_SEQ_LEN, verbose=False)
    ids = gen.prompt_token_ids(tokenizer, prompt)

    def last_logits():
        # The context's logits of the last evaluated token. `llm.scores` is filled only with logits_all=True
        # (llama-cpp-python 0.3.36), which would also keep every prompt position's logits.
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    # Warm-up, as for every engine (module docstring): one token, then forget it. The next eval starts at
    # position 0 and drops the cache from there.
    llm.eval(ids[:1])
    llm.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    llm.eval(ids)
    prefill_s, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    # Greedy text can part from the other engines' at a near-tie: llama.cpp's CPU matmuls round activations to 8 bits.
    out = [int(np.argmax(last_logits()))]
    start, cpu_start = time.perf_counter(), time.process_time()
    while len(out) < new_tokens:
        llm.eval([out[-1]])
        out.append(int(np.argmax(last_logits())))
    decode_s, decode_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {**_result("llama.cpp", prompt, tokenizer, ids, out, prefill_s, decode_s),
            **_cpu_rates(len(ids), len(out), prefill_cpu, decode_cpu)}


def hf_eager(hf_folder: str, tokenizer, prompt: str, new_tokens: int, threads: int) -> dict:
    """transformers generate, greedy; a streamer stamps the prompt and each new token, so prefill
    (prompt -> first token) and decode (the rest) are timed apart in one generate call."""
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    ids = gen.prompt_token_ids(tokenizer, prompt)

    class Stamps(BaseStreamer):
        def __init__(self):
            self.times, self.cpu = [], []

        def put(self, value):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())

        def end(self):
            pass

    stamps = Stamps()
    with torch.no_grad():
        model(torch.tensor([ids[:1]]))  # warm-up, as for every engine (module docstring)
        output = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=stamps, pad_token_id=tokenizer.eos_token_id,
        )
    out = output[0, len(ids):].tolist()
    prefill_s = stamps.times[1] - stamps.times[0]
    decode_s = stamps.times[-1] - stamps.times[1]
    return {**_result("hf-eager-fp32", prompt, tokenizer, ids, out, prefill_s, decode_s),
            **_cpu_rates(len(ids), len(out), stamps.cpu[1] - stamps.cpu[0], stamps.cpu[-1] - stamps.cpu[1])}


def _result(engine, prompt, tokenizer, ids, out, prefill_s, decode_s) -> dict:
    return {
        "engine": engine, "prompt": prompt, "text": tokenizer.decode(out, skip_special_tokens=True).strip(),
        "prompt_tokens": len(ids), "new_tokens": len(out),
        "prefill_tokens_per_s": round(len(ids) / prefill_s, 2),
        "decode_tokens_per_s": round((len(out) - 1) / decode_s, 2),
    }


def _cpu_rates(prompt_tokens: int, new_tokens: int, prefill_cpu_s: float, decode_cpu_s: float) -> dict:
    """Tokens per CPU-second (all threads of this process): a figure that other jobs on a shared CPU
    distort far less than wall-clock tokens/s (spinning thread pools still count)."""
    return {"prefill_tokens_per_cpu_s": round(prompt_tokens / prefill_cpu_s, 2) if prefill_cpu_s > 0 else None,
            "decode_tokens_per_cpu_s": round((new_tokens - 1) / decode_cpu_s, 2) if decode_cpu_s > 0 else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=["lowerbench-pte", "optimum-pte", "llama.cpp", "hf-eager"])
    parser.add_argument("--pte")
    parser.add_argument("--gguf")
    parser.add_argument("--hf", required=True, help="HF folder: tokenizer for every engine, weights for hf-eager")
    parser.add_argument("--prompt", default=gen.DEFAULT_PROMPT)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stock-threads", action="store_true",
                        help="a .pte engine without Lowerbench's thread policy (the baseline for what it buys)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.hf)
    if args.engine == "lowerbench-pte":
        result = executorch_pte(args.pte, tokenizer, args.prompt, args.new_tokens, args.threads, "start")
    elif args.engine == "optimum-pte":
        result = executorch_pte(args.pte, tokenizer, args.prompt, args.new_tokens, args.threads, "all")
    elif args.engine == "llama.cpp":
        result = llama_cpp(args.gguf, tokenizer, args.prompt, args.new_tokens, args.threads)
    else:
        result = hf_eager(args.hf, tokenizer, args.prompt, args.new_tokens, args.threads)
    result["engine"] = args.engine
    result["threads"] = args.threads
    result["thread_policy"] = thread_policy.policy_active()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
