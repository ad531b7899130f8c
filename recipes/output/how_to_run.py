"""The model card's "How to run" section: the recipe folder's files in ExecuTorch's own LLM runner (Python
TextLLMRunner, llama_main) and in ExecuTorch's Android and iOS demo apps, plus the chat template as text,
since every one of them takes raw text. Facts from executorch 1.5.1 and meta-pytorch/executorch-examples."""
from __future__ import annotations

from recipes.output.report import RecipeInfo, Report

# Chat formats the demo apps know, by a token their templates use: (Android LlamaDemo model type,
# etLLM file-name prefix; etLLM picks its prompt format from the .pte's name).
_APP_FORMATS = {
    "<|start_header_id|>": ("LLAMA_3", "llama"),
    "<|im_start|>": ("QWEN_3", "smollm3"),
}


def has_data_file(report: Report) -> bool:
    """The program's weights are in model.ptd beside model.pte."""
    return bool(report.pte and report.pte.ptd_path)


def how_to_run(report: Report, chat_template: str | None) -> list[str]:
    recipe = report.recipe
    metadata = report.llm_metadata.to_dict() if report.llm_metadata else {}
    ptd = has_data_file(report)
    lines = ["## How to run", "",
             "The files: `model.pte` (the program, with the metadata methods ExecuTorch's LLM runners read: "
             + ", ".join(f"`{k}`={v}" for k, v in metadata.items() if v is not None)
             + "), " + ("`model.ptd` (its weights, ExecuTorch's data file: every runner needs it beside the program), "
                        if ptd else "")
             + "`tokenizer.json` (what the runners load), `tokenizer_config.json` (the chat template) and "
             "`report.json`.", ""]
    if report.runtime_note:
        lines += [f"Where it runs: {report.runtime_note}.", ""]
    if recipe.options.get("device_runner"):
        lines += [f"Device runner: {recipe.options['device_runner']}", ""]
    if metadata.get("prefill_input_len"):
        return lines + _static(report) + _template(chat_template)
    if metadata.get("get_kv_io_bit_width"):
        return lines + _kv_io_runner(report, chat_template)
    lines += _kv_cache(recipe, metadata)
    lines += _python(recipe, ptd) + _llama_main(ptd) + _apps(chat_template, ptd) + _template(chat_template)
    return lines


_CACHE_STORAGE = {"int8": "int8, with an fp32 scale and an int8 zero point per token and head, read by ExecuTorch's "
                          "`llama::custom_quantized_sdpa` (the queries are quantized per token too)"}


def _kv_cache(recipe: RecipeInfo, metadata: dict) -> list[str]:
    """What the program's KV cache is, and what that means for the runners: calls of at most get_max_seq_len
    tokens, and positions up to get_max_context_len (a ring goes on past its cache)."""
    cache = recipe.kv_cache
    if cache is None:
        return []
    lines = ["### KV cache", "", f"Stored {_CACHE_STORAGE.get(cache.dtype, cache.dtype)}: {cache.bytes / 1e6:.1f} MB."]
    per_call, context = metadata.get("get_max_seq_len"), metadata.get("get_max_context_len")
    if cache.window:
        lines.append(f"A ring: every token attends to the first {cache.sink_tokens} tokens and to its {cache.window} "
                     f"most recent ones, at any position up to get_max_context_len={context} (the model's own "
                     "limit), so a chat goes on past the cache.")
    if per_call and context and per_call < context:
        lines.append(f"One call takes at most {per_call} tokens (get_max_seq_len): ExecuTorch's LLM runners "
                     f"prefill a longer prompt in calls of that many.")
        if not cache.window:
            lines.append(f"The cache holds {context} positions; executorch 1.5.1's TextLLMRunner reads a program "
                         "that takes fewer tokens per call than its context as a sliding window and does not stop a "
                         f"conversation at {context} positions, so reset() the runner before a chat reaches them.")
    return lines + [""]


def _static(report: Report) -> list[str]:
    """A static-shape program (recipes/lowering/static_program.py), in the layout of ExecuTorch's static Llama export:
    run_static.py drives it here, ExecuTorch's StaticAttentionIOManager on a device; TextLLMRunner cannot."""
    metadata = report.llm_metadata
    cache = [1, metadata.n_heads_per_cache, metadata.get_max_context_len - 1, metadata.head_dim]
    ran_here = any(g.engine == "executorch-runtime" for g in report.generations)
    return ["### Python: `run_static.py` (in this folder)", "",
            f"This program has fixed shapes, in the layout of ExecuTorch's own static Llama export "
            "(`examples/apple/coreml/llama/export_static_llm_coreml.py`): a `prefill` method taking "
            f"{metadata.prefill_input_len} tokens per call and a `forward` method taking 1 (decode), which share their "
            f"weights; the K/V caches ({cache} per layer), the attention masks and the rope rows of each call's "
            "positions are inputs and outputs, held by the caller, and each call returns its last real token's "
            "logits. Constant methods (`prefill_kv_cache_specs`, `decode_mask_specs`, `freqs_cos`, ...) say where "
            "each input sits. `run_static.py` holds the caches, prefills the chat-templated prompt chunk by chunk, "
            "decodes until a stop id and prints the answer, with ExecuTorch's Python runtime:", "", "```sh",
            "pip install executorch transformers",
            'python run_static.py --prompt "What is the capital of France?" --max-new-tokens 128', "```", "",
            ("Lowerbench ran `run_static.py`'s loop on this very file here (engine `executorch-runtime` under Sample "
             "generations)." if ran_here else
             "Lowerbench could not run this file here (see Where it runs); the generation and fidelity shown are the "
             "same static module in PyTorch, driven by `run_static.py`'s own loop (engine "
             f"`{report.generations[-1].engine if report.generations else 'eager-quantized'}`)."), "",
            "### C++ runners and the demo apps", "",
            "On a device, drive it with ExecuTorch's C++ `StaticAttentionIOManager` "
            "(`examples/models/llama/runner/static_attention_io_manager.h`; smart-mask caches), configured from the "
            "constant methods: `n_heads_per_cache`, `head_dim`, `freqs_cos`/`freqs_sin`, and for each method its "
            "`_input_len`, `_kv_cache_specs` (k in, k out, v in, v out, cache length), `_mask_specs` and "
            "`_freqs_cos_input_index`/`_freqs_sin_input_index`; the last input is the last real token's index. "
            "Its inputs and outputs are not memory-planned, so the manager binds its own buffers. (Lowerbench checks "
            "the program's methods, specs and constants against ExecuTorch's own static export; the C++ manager has "
            "not run on it here.) ExecuTorch's "
            "`TextLLMRunner` (behind `llama_main` and the Android and iOS demo apps' default path) cannot drive it: "
            "it expects one `forward` method that keeps its KV cache as state.", ""]


# Qualcomm's qnn_llama_runner formats the prompt itself, by --decoder_model_version; the versions whose template is
# this model's, by a token of it.
_QNN_DECODER_VERSIONS = {"<|im_start|>": "smollm2_135m", "<|start_header_id|>": "llama3"}


def _kv_io_runner(report: Report, chat_template: str | None) -> list[str]:
    """A program of prefill_forward and kv_forward methods with the KV caches as inputs and outputs
    (recipes/lowering/kv_io_program.py): Qualcomm's qnn_llama_runner in hybrid mode runs it on the device."""
    arch = str(report.recipe.options.get("htp_arch") or "v75").lstrip("v")
    version = next((v for token, v in _QNN_DECODER_VERSIONS.items() if chat_template and token in chat_template),
                   "llama2")
    context = report.llm_metadata.get_max_context_len if report.llm_metadata else 128
    return ["### Android (Snapdragon): Qualcomm's `qnn_llama_runner`", "",
            "This program has the methods Qualcomm's Llama runner loads in its hybrid mode: `prefill_forward` "
            "(several tokens per call) and `kv_forward` (one), sharing their weights; the runner keeps the K/V "
            "caches and passes them to each call. Build the runner as ExecuTorch's "
            "`examples/qualcomm/oss_scripts/llama/README.md` says (v1.5.1, `backends/qualcomm/scripts/build.sh` "
            "with the QNN SDK), then push it, the QNN runtime libraries of the SDK the context binary was compiled "
            f"with (the report's `qnn_libraries`; HTP {report.recipe.options.get('htp_arch') or 'v75'}), this "
            "program and its tokenizer:", "", "```sh",
            "adb shell mkdir -p /data/local/tmp/llama",
            "adb push build-android/examples/qualcomm/oss_scripts/llama/qnn_llama_runner /data/local/tmp/llama/",
            "adb push $QNN_SDK_ROOT/lib/aarch64-android/libQnnHtp.so $QNN_SDK_ROOT/lib/aarch64-android/libQnnSystem.so "
            f"$QNN_SDK_ROOT/lib/aarch64-android/libQnnHtpV{arch}Stub.so /data/local/tmp/llama/",
            f"adb push $QNN_SDK_ROOT/lib/hexagon-v{arch}/unsigned/libQnnHtpV{arch}Skel.so /data/local/tmp/llama/",
            "adb push model.pte tokenizer.json /data/local/tmp/llama/",
            "adb shell 'cd /data/local/tmp/llama && export LD_LIBRARY_PATH=. ADSP_LIBRARY_PATH=. && "
            f"./qnn_llama_runner --decoder_model_version {version} --model_path model.pte "
            f"--tokenizer_path tokenizer.json --eval_mode 1 --seq_len {context} --temperature 0 "
            '--prompt "What is the capital of France?"\'', "```", "",
            f"`--decoder_model_version {version}` makes the runner wrap the prompt in "
            + ("this model's chat format and stop at its end-of-turn token." if chat_template and version != "llama2"
               else "Llama 2's format; none of the runner's versions has this model's chat template, so give it the "
                    "prompt already formatted with the template below.")
            + f" `--seq_len` is at most the context, {context} tokens. Lowerbench has not run this on a device; the "
            "generation and fidelity shown here are the same two methods simulated in PyTorch, prefilling and "
            "decoding as the runner does.", ""] + (_template(chat_template) if version == "llama2" else [])


def _python(recipe: RecipeInfo, ptd: bool) -> list[str]:
    return ["### Python: ExecuTorch's TextLLMRunner (in the `executorch` wheel)", "", "```python",
            "import torch  # loads libtorch, which the runner links against",
            "from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  llama::custom_sdpa, update_cache",
            "import executorch.kernels.quantized  # noqa: F401  quantized embedding kernels",
            "from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner",
            "from transformers import AutoTokenizer",
            "",
            'runner = TextLLMRunner("model.pte", "tokenizer.json"' + (', data_path="model.ptd")' if ptd else ")"),
            "# The runner takes raw text: apply the chat template first (tokenizer_config.json holds it).",
            'prompt = AutoTokenizer.from_pretrained(".").apply_chat_template(',
            '    [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False)',
            "runner.generate(prompt, GenerationConfig(max_new_tokens=128, temperature=0.0, echo=False),",
            '                token_callback=lambda piece: print(piece, end="", flush=True),',
            "                stats_callback=lambda stats: print(stats.to_json_string()))",
            "```", "",
            f"Lowerbench ran exactly these lines' runner on this folder where a `{recipe.backend}` program runs on its "
            "host; its answer and statistics are under Sample generations (engine `executorch-llm-runner`).", ""]


def _llama_main(ptd: bool) -> list[str]:
    return ["### C++: `llama_main`", "",
            "Build it as ExecuTorch's `examples/models/llama/README.md` says (v1.5.1), with the backend this program "
            "delegates to, then:", "", "```sh",
            "cmake-out/examples/models/llama/llama_main --model_path=model.pte "
            + ("--data_paths=model.ptd " if ptd else "") + "--tokenizer_path=tokenizer.json \\",
            '  --prompt="$(cat prompt.txt)" --temperature=0 --max_new_tokens=128 --warmup=1',
            "```", "",
            "`prompt.txt` is the prompt with the chat template below applied. `--num_bos` stays 0: the template "
            "writes any BOS itself.", ""]


def _apps(chat_template: str | None, ptd: bool) -> list[str]:
    android_type, ios_prefix = next(
        (formats for token, formats in _APP_FORMATS.items() if chat_template and token in chat_template),
        (None, None))
    lines = ["### Android: ExecuTorch's LlamaDemo app (meta-pytorch/executorch-examples, `llm/android/LlamaDemo`)", "",
             "```sh", "adb shell mkdir -p /data/local/tmp/llama",
             "adb push model.pte /data/local/tmp/llama/",
             *(["adb push model.ptd /data/local/tmp/llama/"] if ptd else []),
             "adb push tokenizer.json /data/local/tmp/llama/", "```", "",
             "In the app's settings pick `model.pte` as the model "
             + ("(and `model.ptd` as its data file) " if ptd else "") + "and `tokenizer.json` as the tokenizer. The app wraps "
             "your text in the prompt format of the model type you choose: "
             + (f"choose `{android_type}`, whose format is this model's chat template." if android_type else
                "no built-in type has this model's chat template, so edit the prompt templates in the settings to "
                "the template below."), "",
             "### iOS / macOS: ExecuTorch's etLLM app (meta-pytorch/executorch-examples, `llm/apple`)", "",
             "Copy `model.pte`" + (", `model.ptd`" if ptd else "") + " and `tokenizer.json` into the app's folder (Finder or Files: On My iPhone > etLLM) and "
             "select them in the app. etLLM picks its prompt format from the `.pte`'s file name: "
             + (f"rename it to `{ios_prefix}-model.pte`, whose format is this model's chat template." if ios_prefix else
                "none of its formats is this model's chat template, so its answers will be off until the app "
                "formats prompts with the template below."), ""]
    return lines


def _template(chat_template: str | None) -> list[str]:
    if not chat_template:
        return ["### Prompt format", "", "This tokenizer has no chat template: give the runners the plain text.", ""]
    return ["### Chat template (Jinja, from tokenizer_config.json)", "",
            "The runners take raw text; render this template with your messages and `add_generation_prompt=True` "
            "(transformers' `apply_chat_template(..., tokenize=False)` does) and pass the result as the prompt.", "",
            "```jinja", chat_template, "```", ""]
