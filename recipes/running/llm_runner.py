"""Sample generations from ExecuTorch's own LLM runner (`executorch.extension.llm.runner.TextLLMRunner`, the
C++ runner behind llama_main and the Android/iOS demo apps) on a recipe folder's model.pte + tokenizer.json,
with the runner's own statistics."""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from models.errors import UserFacingError
from models.prompting import prompt_text, prompt_token_ids, stop_token_ids
from recipes.process import thread_policy
from recipes.files.pte_program import data_file_of
from recipes.output.report import RunnerGeneration

ENGINE_LLM_RUNNER = "executorch-llm-runner"

# What a .pte may use outside its delegates (llama::custom_sdpa, llama::update_cache, quantized embeddings):
# the runner resolves ops when it loads the method, so their kernels register first.
_KERNEL_MODULES = ("executorch.extension.llm.custom_ops.custom_ops", "executorch.kernels.quantized")


class RunnerFailed(UserFacingError):
    """The runner could not load or run a file; the message is one line for the report."""


def generate_with_runner(pte: Path, tokenizer_json: Path, tokenizer, prompt: str, max_new_tokens: int,
                         temperature: float = 0.0, eos_token_ids=(), runtime_imports: tuple[str, ...] = ()
                         ) -> RunnerGeneration:
    """The .ptd beside the .pte, when there is one, goes to the runner with it. The runner takes raw text, so the prompt goes in as the chat template's text with no BOS added
    (num_bos=0): the same token ids the step loop feeds. The runner stops on the .pte's get_eos_ids."""
    import torch  # noqa: F401  (loads libtorch, which the runner's extension links against)

    for name in (*_KERNEL_MODULES, *runtime_imports):
        importlib.import_module(name)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    ptd = data_file_of(pte)
    try:
        with _stdout_silenced():
            runner = TextLLMRunner(str(pte), str(tokenizer_json), data_path=str(ptd) if ptd is not None else None)
    except RuntimeError as err:
        raise RunnerFailed(f"ExecuTorch's LLM runner could not load {Path(pte).name} with "
                           f"{Path(tokenizer_json).name}: {err}") from None
    text = prompt_text(tokenizer, prompt)
    pieces, stats = [], []
    try:
        with thread_policy.runtime_threads(), _stdout_silenced():
            # Warm-up as llama_main --warmup does: the first call's workspace planning stays out of the timings.
            runner.generate(text, GenerationConfig(max_new_tokens=2, temperature=0.0, echo=False, warming=True))
            runner.reset()
            runner.generate(text, GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                   echo=False), token_callback=pieces.append,
                            stats_callback=stats.append)
    except UnicodeDecodeError:
        raise RunnerFailed("ExecuTorch's LLM runner emitted a token that is not whole UTF-8 text, which its Python "
                           "binding cannot pass on") from None
    except RuntimeError as err:
        raise RunnerFailed(f"ExecuTorch's LLM runner failed while generating: {err}") from None
    figures = json.loads(stats[0].to_json_string())
    stop_texts = {tokenizer.decode([i]) for i in stop_token_ids(tokenizer, eos_token_ids)}
    # The runner emits the stop token's text before it stops; the step loop's text leaves it out.
    shown = pieces[:-1] if pieces and pieces[-1] in stop_texts else pieces
    expected = len(prompt_token_ids(tokenizer, prompt))
    return RunnerGeneration(
        engine=ENGINE_LLM_RUNNER,
        prompt=prompt,
        text="".join(shown).strip(),
        prompt_tokens=figures["prompt_tokens"],
        new_tokens=len(pieces),
        prefill_tokens_per_s=_rate(figures["prompt_tokens"], figures["prompt_eval_end_ms"] - figures["inference_start_ms"]),
        decode_tokens_per_s=_rate(figures["generated_tokens"], figures["inference_end_ms"] - figures["prompt_eval_end_ms"]),
        model_load_ms=figures["model_load_end_ms"] - figures["model_load_start_ms"],
        time_to_first_token_ms=figures["first_token_ms"] - figures["inference_start_ms"],
        pieces=pieces,
        prompt_note=None if figures["prompt_tokens"] == expected else
        f"the runner tokenized the prompt to {figures['prompt_tokens']} tokens, the step loop feeds {expected}",
    )


def runner_generation(pte: Path, tokenizer_json: Path, tokenizer, prompt: str, max_new_tokens: int,
                      temperature: float = 0.0, eos_token_ids=(), runtime_imports: tuple[str, ...] = ()
                      ) -> tuple[RunnerGeneration | None, str | None]:
    """generate_with_runner, or (None, why not) when the runner cannot take the file: a report's runner_note.
    The runner's failure must not withhold the step loop's generation or the files."""
    try:
        return generate_with_runner(pte, tokenizer_json, tokenizer, prompt, max_new_tokens, temperature,
                                    eos_token_ids, runtime_imports), None
    except RunnerFailed as err:
        return None, str(err)
    except Exception as err:
        return None, f"ExecuTorch's LLM runner failed: {type(err).__name__}: {err}"


def _rate(tokens: int, milliseconds: int) -> float:
    """Tokens per second as the runner's own report computes them; 0.0 below its millisecond clock."""
    return round(tokens * 1000 / milliseconds, 2) if milliseconds > 0 else 0.0


@contextmanager
def _stdout_silenced():
    """The runner prints every token and its stats line to the C stdout, where the CLI writes its JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
