"""The KV cache options of the XNNPACK recipes (kv_cache, kv_cache_window), long contexts and their limits: the
programs on ExecuTorch's runtime and in its LLM runner, their metadata, and the memory estimate's caches."""
import json

import pytest
import torch

from models.errors import UserFacingError
from tests.conftest import run_main


# Programs lowered once per session and shared by the tests: a step starts each use at position 0, and its cache
# rows past the positions fed are never attended (the custom ops read rows up to the position; a ring masks them).
_PROGRAMS: dict[tuple, tuple] = {}


def _lowered_step(checkpoint, max_seq_len: int, options: dict, recipe_name: str = "xnnpack-fp32"):
    """(runtime step, the .pte's metadata, the module) of `recipe_name` with these recipe options."""
    key = (id(checkpoint), max_seq_len, tuple(sorted(options.items())), recipe_name)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _lower_step(checkpoint, max_seq_len, options, recipe_name)
    return _PROGRAMS[key]


def _lower_step(checkpoint, max_seq_len: int, options: dict, recipe_name: str):
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.running import generate as gen
    from recipes.registry import get_recipe

    recipe = get_recipe(recipe_name)
    made = prepare_and_lower(RecipeJob(recipe, options, checkpoint, max_seq_len))
    step = gen.runtime_step(gen.load_runtime_method(made.lowered.pte, recipe.backend.runtime_imports))
    return step, made.metadata, made.module


def _greedy(step, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens past any end-of-sequence, and the logits each was picked from."""
    logits = step(torch.tensor([ids]), torch.tensor([0]))[0, -1].clone()
    tokens, rows = [], []
    for position in range(len(ids), len(ids) + new_tokens):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        logits = step(torch.tensor([[tokens[-1]]]), torch.tensor([position]))[0, -1].clone()
    return tokens, torch.stack(rows)


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    ref, oth = torch.log_softmax(reference.double(), -1), torch.log_softmax(other.double(), -1)
    return (ref.exp() * (ref - oth)).sum(-1)


def test_int8_cache_gives_the_fp32_caches_greedy_tokens_but_for_a_near_tie(tiny_checkpoint):
    """64 greedy tokens of the tiny Llama on the runtime, fp32 against int8 caches. Measured: the same tokens up to
    new token 33, where the fp32 cache's two top logits are 6e-4 apart and the int8 cache's rounding picks the
    other; teacher-forced on the fp32 sequence the int8 cache's logits are within KL 1.1e-7 at every position
    (5e-8 at token 33). The test holds either outcome: identical tokens, or a first divergence at a near-tie."""
    from models.prompting import prompt_token_ids

    ids = prompt_token_ids(tiny_checkpoint.tokenizer, "the capital of France is")
    fp32_step, _, _ = _lowered_step(tiny_checkpoint, 128, {"kv_cache": "fp32"})
    int8_step, metadata, _ = _lowered_step(tiny_checkpoint, 128, {"kv_cache": "int8"})
    fp32_tokens, _ = _greedy(fp32_step, ids, 64)
    int8_tokens, _ = _greedy(int8_step, ids, 64)

    sequence = torch.tensor([ids + fp32_tokens[:-1]])
    forced = {name: step(sequence, torch.tensor([0]))[0, len(ids) - 1:].clone()
              for name, step in (("fp32", fp32_step), ("int8", int8_step))}
    kl = _kl(forced["fp32"], forced["int8"])
    assert kl.max().item() < 1e-6, kl.max().item()
    diverged = next((i for i, (a, b) in enumerate(zip(fp32_tokens, int8_tokens)) if a != b), None)
    if diverged is not None:
        top_two = forced["fp32"][diverged].topk(2).values
        assert (top_two[0] - top_two[1]).item() < 1e-3, (diverged, top_two)
        assert forced["int8"][diverged].argmax().item() == int8_tokens[diverged]
    # the program reads its int8 cache in place, through llama::custom_quantized_sdpa
    assert metadata["use_sdpa_with_kv_cache"] is True and metadata["get_max_seq_len"] == 128


@pytest.mark.parametrize("cache", ["fp16", "int8"])
def test_a_cache_dtype_follows_the_fp32_cache_on_the_runtime(tiny_checkpoint, cache):
    """A prefill and decode steps on the runtime against the fp32 cache's program: fp16 rounds the keys and
    values, int8 also the queries, each within a small KL of fp32."""
    tokens = torch.tensor([[3, 5, 7, 2, 9, 4, 6, 8, 10, 11]])
    steps = {name: _lowered_step(tiny_checkpoint, 128, {"kv_cache": name})[0] for name in ("fp32", cache)}
    logits = {name: step(tokens, torch.tensor([0])).clone() for name, step in steps.items()}
    assert _kl(logits["fp32"][0], logits[cache][0]).max().item() < 1e-5
    assert not torch.equal(logits["fp32"], logits[cache])


def _window_reference(checkpoint, tokens: torch.Tensor, window: int) -> torch.Tensor:
    """Eager aten SDPA over a whole cache, each token allowed the first 4 tokens and its `window` most recent."""
    from models.llama import ExportOptions, build_exportable
    from models.module_options import ATTENTION_SINK_TOKENS

    length = tokens.shape[1]
    module = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(length, attention="sdpa"))
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    module.causal_mask.copy_((key <= query) & ((key < ATTENTION_SINK_TOKENS) | (key > query - window)))
    with torch.no_grad():
        return module(tokens, torch.tensor([0]))


def test_ring_cache_on_the_runtime_attends_to_the_sinks_and_the_window_past_its_rows(tiny_checkpoint):
    """A ring of 8 recent tokens (+4 sinks) fed 3 prefill calls and 60 decode steps, far past its 19 rows: every
    position's logits are those of full attention masked to the sinks and the window."""
    window = 8
    step, metadata, module = _lowered_step(tiny_checkpoint, 32, {"kv_cache": "fp32", "kv_cache_window": window})
    assert module.options.cache_rows == 4 + window + window - 1
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, tiny_checkpoint.config.vocab_size, (1, 80), generator=generator)
    prefill = step(tokens[:, :20], torch.tensor([0])).clone()  # more than one call takes: 8 + 8 + 4
    decoded = [step(tokens[:, i:i + 1], torch.tensor([i])).clone() for i in range(20, 80)]
    got = torch.cat([prefill, *decoded], dim=1)
    expected = _window_reference(tiny_checkpoint, tokens, window)
    assert (got - expected).abs().max().item() < 1e-4
    # a call takes at most the window; positions go as far as the model's own
    assert metadata["get_max_seq_len"] == window
    assert metadata["get_max_context_len"] == tiny_checkpoint.config.max_position_embeddings


def test_int8_ring_cache_on_the_runtime_follows_the_fp32_ring(tiny_checkpoint):
    tokens = torch.randint(3, tiny_checkpoint.config.vocab_size, (1, 50), generator=torch.Generator().manual_seed(1))
    logits = {}
    for cache in ("fp32", "int8"):
        step = _lowered_step(tiny_checkpoint, 32, {"kv_cache": cache, "kv_cache_window": 8})[0]
        logits[cache] = torch.cat([step(tokens[:, :12], torch.tensor([0])).clone(),
                                   *(step(tokens[:, i:i + 1], torch.tensor([i])).clone() for i in range(12, 50))], 1)
    assert _kl(logits["fp32"][0], logits["int8"][0]).max().item() < 1e-5


def test_chunked_program_tells_the_runner_its_call_size_and_context(runner_llama_dir, tmp_path):
    """At a context above XNNPACK's 512-token calls the program takes 512 tokens a call over a cache of the
    whole context, and its metadata says both: ExecuTorch's LLM runner prefills a 700-token prompt in two calls
    and answers as the step loop, which chunks the same way."""
    from models.sources.checkpoint import load_checkpoint
    from models.prompting import prompt_token_ids
    from recipes.running import generate as gen
    from recipes.backends.xnnpack import PREFILL_CHUNK_TOKENS
    from recipes.running.llm_runner import generate_with_runner
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe
    from recipes.files.tokenizer_files import tokenizer_files

    checkpoint = load_checkpoint(str(runner_llama_dir))
    recipe = get_recipe("xnnpack-fp32")
    made = prepare_and_lower(RecipeJob(recipe, {}, checkpoint, 1024))
    module, metadata, lowered = made.module, made.metadata, made.lowered
    assert (metadata["get_max_seq_len"], metadata["get_max_context_len"]) == (PREFILL_CHUNK_TOKENS, 1024) == (512, 1024)
    (tmp_path / "model.pte").write_bytes(lowered.pte)
    for name, data in tokenizer_files(checkpoint.tokenizer).items():
        (tmp_path / name).write_bytes(data)

    prompt = "the capital of France is Paris . " * 110
    assert 600 < len(prompt_token_ids(checkpoint.tokenizer, prompt)) < 1000
    step = gen.runtime_step(gen.load_runtime_method(lowered.pte, recipe.backend.runtime_imports))
    looped = gen.generate(step, "executorch-runtime", checkpoint.tokenizer, prompt, 6, 1024)
    eager = gen.generate(gen.eager_step(module), "eager", checkpoint.tokenizer, prompt, 6, 1024)
    runner = generate_with_runner(tmp_path / "model.pte", tmp_path / "tokenizer.json", checkpoint.tokenizer, prompt,
                                  6, eos_token_ids=checkpoint.eos_token_ids)
    assert runner.prompt_tokens == looped.prompt_tokens > PREFILL_CHUNK_TOKENS
    assert looped.tokens == eager.tokens
    assert runner.pieces == [checkpoint.tokenizer.decode([t]) for t in looped.tokens]


def test_context_beyond_the_models_own_is_refused_before_any_export(tiny_llama_dir, tmp_path):
    limit = json.loads((tiny_llama_dir / "config.json").read_text())["max_position_embeddings"]
    result = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-8da4w", "--out", str(tmp_path / "o"),
                      "--max-seq-len", str(limit + 1), "--export-only")
    assert result.returncode == 2
    assert f"max context {limit + 1} is beyond this model's limit of {limit} tokens" in result.stderr
    assert "--kv-cache-window" in result.stderr and not (tmp_path / "o").exists()


def test_kv_cache_flags_reach_the_recipe_options_and_bad_values_are_refused(tiny_llama_dir, tmp_path):
    from recipes.request import user_options

    assert user_options(kv_cache="int8", kv_cache_window=256) == {"kv_cache": "int8", "kv_cache_window": 256}
    assert user_options(kv_cache="", kv_cache_window=0) == {}
    refused = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(tmp_path / "o"),
                       "--option", "kv_cache=int4")
    assert refused.returncode == 2 and "kv_cache 'int4' is not a KV cache dtype" in refused.stderr
    refused = run_main("run", "--model", str(tiny_llama_dir), "--recipe", "xnnpack-fp32", "--out", str(tmp_path / "o"),
                       "--kv-cache", "int4")
    assert refused.returncode == 2 and "invalid choice" in refused.stderr


def test_every_xnnpack_recipe_takes_the_cache_options_and_builds_its_form():
    from models.llama import ExportOptions
    from recipes.registry import RECIPES, load_backends
    from recipes.request import recipe_defaults

    load_backends()
    for recipe in (r for r in RECIPES.values() if r.backend.name == "xnnpack"):
        defaults = recipe_defaults(recipe)
        own = "fp16" if recipe.quantization == "fp16" else "fp32"
        assert (defaults["kv_cache"], defaults["kv_cache_window"]) == (own, 0), recipe.name
        assert recipe.export_options(64) == recipe.export_options(64, defaults)
        int8 = recipe.export_options(64, {"kv_cache": "int8", "kv_cache_window": 32})
        assert (int8.attention, int8.kv_cache_dtype, int8.kv_window, int8.call_tokens) == ("custom", "int8", 32, 32)
    # the fp16 recipe keeps aten SDPA over its fp16 cache unless asked for another cache
    assert RECIPES["xnnpack-fp16"].export_options(64).attention == "sdpa"
    assert isinstance(RECIPES["xnnpack-fp16"].export_options(64), ExportOptions)


def test_fp16_recipe_with_an_int8_cache_runs_on_the_runtime(tiny_checkpoint):
    """xnnpack-fp16 computes in fp16; its int8 cache is quantized from fp16 keys and values upcast, and the
    attention's fp32 result goes back to fp16."""
    step, metadata, module = _lowered_step(tiny_checkpoint, 32, {"kv_cache": "int8"}, recipe_name="xnnpack-fp16")
    assert module.options.attention == "custom" and module.model.layers[0].self_attn.k_cache.dtype == torch.int8
    tokens = torch.tensor([[3, 5, 7, 2, 9, 4]])
    with torch.no_grad():
        module.reset_cache()
        eager = module(tokens, torch.tensor([0])).float()
    runtime = step(tokens, torch.tensor([0])).float()
    assert runtime.dtype == torch.float32 and (runtime - eager).abs().max().item() < 0.05
    assert torch.equal(runtime.argmax(-1), eager.argmax(-1))


def test_estimate_counts_the_caches_in_their_dtype():
    """The module holds the caches until lowered, then the program on the runtime (the module is released once
    its program is written): int8 keeps a byte per value and 5 bytes (fp32 scale, int8 zero point) per token and
    head, against fp32's 4 per value."""
    from bench.scale_models import CONFIGS
    from models.llama import LlamaShape
    from recipes.estimates.memory_estimate import estimate_job
    from recipes.registry import get_recipe
    from transformers import LlamaConfig

    config = LlamaConfig(**CONFIGS["llama-3.2-1b"])
    shape, recipe = LlamaShape.from_config(config), get_recipe("xnnpack-8da4w")
    context = 8192
    jobs = {cache: estimate_job(config, [recipe], context, True, budget_bytes=10**12,
                                options={recipe.name: {"kv_cache": cache}}).recipes[0].stages
            for cache in ("fp32", "int8")}
    values = 2 * shape.n_layers * context * shape.n_kv_heads * shape.head_dim
    per_head_rows = 2 * shape.n_layers * context * shape.n_kv_heads
    saved = values * 4 - (values + per_head_rows * 5)
    assert jobs["fp32"]["generate"] - jobs["int8"]["generate"] == pytest.approx(saved, abs=8)
    assert jobs["fp32"]["lower"] - jobs["int8"]["lower"] >= saved
    assert jobs["fp32"]["export"] > jobs["int8"]["export"]


def test_estimate_refuses_a_context_that_cannot_fit_with_the_numbers(monkeypatch):
    """Llama-3.2-3B's shape at its own 131072 tokens: fp32 caches alone are 15 GB, twice over (module and program);
    the refusal says the peak, the limit, and what smaller caches would take."""
    from bench.scale_models import CONFIGS
    from recipes.estimates.memory_estimate import LIMIT_ENV, check_job_fits, estimate_job
    from recipes.registry import get_recipe
    from transformers import LlamaConfig

    config = LlamaConfig(**CONFIGS["llama-3.2-3b"])
    recipe = get_recipe("xnnpack-8da4w")
    context = config.max_position_embeddings
    monkeypatch.setenv(LIMIT_ENV, "4")  # below any free RAM a test host has, so the limit is the budget
    options = {recipe.name: {"quant_algorithm": "hqq"}}
    fp32 = estimate_job(config, [recipe], context, False, options=options)
    with pytest.raises(UserFacingError) as info:
        check_job_fits(config, [recipe], context, False, options)
    message = str(info.value)
    assert f"needs about {fp32.peak_rss_bytes / 1e9:.1f} GB of memory at its peak" in message
    assert "the limit of 4 GB (LOWERBENCH_MEMORY_LIMIT_GB) allows 4.0 GB" in message
    int8 = estimate_job(config, [recipe], context, False, options={recipe.name: {"quant_algorithm": "hqq",
                                                                                   "kv_cache": "int8"}})
    assert f"smaller KV caches (--kv-cache int8: {int8.peak_rss_bytes / 1e9:.1f} GB)" in message
    assert "--kv-cache-window 2048" in message
    assert fp32.peak_rss_bytes > 30e9 > int8.peak_rss_bytes


def _chat_turns(folder, questions: list[str], max_new_tokens: int) -> list[dict]:
    """One conversation in ExecuTorch's LLM runner: each question a generate() call on the same runner (its
    position carries on), with the chat template of the folder's tokenizer closing the previous answer first."""
    import importlib

    from transformers import AutoTokenizer

    from recipes.backends.xnnpack import BACKEND
    from recipes.running.llm_runner import _KERNEL_MODULES, _stdout_silenced

    for name in (*_KERNEL_MODULES, *BACKEND.runtime_imports):
        importlib.import_module(name)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with _stdout_silenced():
        runner = TextLLMRunner(str(folder / "model.pte"), str(folder / "tokenizer.json"))
    turns = []
    for i, question in enumerate(questions):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        text = ("<|im_end|>\n" if i else "") + text  # the runner does not feed the end of turn it stopped on
        pieces, stats = [], []
        try:
            with _stdout_silenced():
                runner.generate(text, GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, echo=False),
                                token_callback=pieces.append, stats_callback=stats.append)
        except UnicodeDecodeError:
            # The Python binding cannot pass on a token that is part of a character (a byte of a Greek letter, say);
            # the C++ runner keeps its position and the next turn goes on from there. The turn ends at that token.
            turns.append({"question": question, "answer": "".join(pieces), "not_whole_utf8": True,
                          "prompt_tokens": len(tokenizer(text, add_special_tokens=False).input_ids),
                          "generated_tokens": len(pieces) + 1})
            continue
        figures = json.loads(stats[0].to_json_string())
        turns.append({"question": question, "answer": "".join(pieces), "prompt_tokens": figures["prompt_tokens"],
                      "generated_tokens": figures["generated_tokens"]})
    return turns


def _loops(text: str) -> bool:
    """A repetition loop, as a broken cache makes one: the answer ends in one phrase (one to eight words) said
    three times in a row or more. An answer that comes back to a phrase between other words (a small model's
    "the capital of ... the capital of") is not one."""
    words = text.replace("<|im_end|>", " ").split()
    return any(len(words) >= 3 * k and words[-k:] * 3 == words[-3 * k:] for k in range(1, 9))


@pytest.mark.builtin
def test_builtin_int8_cache_answers_paris_in_the_llm_runner(builtin_int8_ring_folder):
    """The built-in model's int8-cache program (a ring larger than the question and its answer) in ExecuTorch's
    own runner, as a device app runs it. The plain int8 cache (no ring) is checked on the runtime above."""
    from transformers import AutoTokenizer

    from recipes.running.generate import DEFAULT_PROMPT
    from recipes.running.llm_runner import generate_with_runner
    from tests.test_deploy import constant_methods

    folder, report = builtin_int8_ring_folder
    assert report.errors == [] and report.recipe.options["kv_cache"] == "int8"
    assert (report.recipe.kv_cache.dtype, report.recipe.kv_cache.window) == ("int8", 64)
    metadata = constant_methods(folder / "model.pte")
    assert metadata["get_max_seq_len"] == 64 and metadata["get_max_context_len"] == 8192  # SmolLM2's own
    tokenizer = AutoTokenizer.from_pretrained(folder)
    answer = generate_with_runner(folder / "model.pte", folder / "tokenizer.json", tokenizer, DEFAULT_PROMPT, 32,
                                  eos_token_ids=metadata["get_eos_ids"])
    assert "Paris" in answer.text and answer.prompt_note is None


CAPITALS = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Egypt": "Cairo", "Canada": "Ottawa",
            "Russia": "Moscow", "China": "Beijing", "Italy": "Rome", "Spain": "Madrid", "Greece": "Athens",
            "Portugal": "Lisbon", "Mexico": "Mexico City", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
            "India": "New Delhi", "Poland": "Warsaw", "Australia": "Canberra", "Ireland": "Dublin",
            "Sweden": "Stockholm"}


@pytest.mark.builtin
def test_builtin_ring_cache_chats_on_past_its_window_in_the_llm_runner(builtin_int8_ring_folder):
    """A 20-question chat in one runner, its positions going on to about 1000 (16 times the ring of 64 recent
    tokens), more than 3 windows of tokens generated: no error, no answer in a repetition loop, and the answers
    still name capitals after many laps of the ring. Answers stop at 40 tokens: past that, with 4 sinks and 64
    recent tokens, an answer no longer sees its own question, and the 135M model then repeats a phrase (Ireland's
    answer did at 64 tokens). Measured (hqq qparams, int8 cache, bf16 group scales): 13 of the 20 right (6 of the
    last 8), 17 ending on their own; most misses repeat an earlier answer's country (Russia -> Canada's). Greece's
    answer starts in Greek letters, a token that is part of a character, which the runner's Python binding cannot
    pass on: such a turn ends there, the conversation going on, and counts as wrong."""
    from tests.conftest import BUILTIN_RING_WINDOW

    folder, _report = builtin_int8_ring_folder
    turns = _chat_turns(folder, [f"What is the capital of {country}?" for country in CAPITALS], 40)
    assert sum(t.get("not_whole_utf8", False) for t in turns) <= 2, turns
    generated = sum(t["generated_tokens"] for t in turns)
    positions = sum(t["prompt_tokens"] + t["generated_tokens"] for t in turns)
    assert generated >= 3 * BUILTIN_RING_WINDOW and positions > 10 * BUILTIN_RING_WINDOW
    assert not [t for t in turns if _loops(t["answer"])], turns
    assert sum(t["answer"].endswith("<|im_end|>") for t in turns) >= 3 * len(turns) // 4, turns  # most end on their own
    right = [t for t, capital in zip(turns, CAPITALS.values()) if capital in t["answer"]]
    assert len(right) >= len(turns) // 2, turns
    assert sum(capital in t["answer"] for t, capital in zip(turns[-8:], list(CAPITALS.values())[-8:])) >= 4, turns


def test_browser_kv_cache_controls_reach_the_report(tiny_llama_dir, tmp_path):
    """The Advanced accordion's KV cache dropdown and window, on a lower-only job of the tiny Llama: the report's
    recipe options and the .pte's metadata carry them."""
    import re

    from playwright.sync_api import expect, sync_playwright

    from tests.conftest import choose_local_folder, launch_browser, running_app

    with running_app(tmp_path) as app, sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 2000})
        page.goto(app["url"])
        choose_local_folder(page, tiny_llama_dir)
        page.get_by_text("Advanced", exact=True).click()
        page.get_by_label("Lower only: write the .pte").check()
        page.get_by_label("KV cache", exact=True).click()
        page.get_by_role("option", name=re.compile(r"^int8 — ")).click()
        page.get_by_label("KV cache window (0 = off)").fill("16")
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.locator("#status")).to_contain_text("1 of 1 recipes finished", timeout=600_000)
        browser.close()
    (job,) = list(app["jobs"].iterdir())
    report = json.loads((job / "report.json").read_text())  # a one-recipe job's folder is the recipe's
    assert report["recipe"]["name"] == "xnnpack-8da4w" and not report["errors"]
    assert (report["recipe"]["options"]["kv_cache"], report["recipe"]["options"]["kv_cache_window"]) == ("int8", 16)
    assert report["llm_metadata"]["get_max_seq_len"] == 16
    assert (report["recipe"]["kv_cache"]["dtype"], report["recipe"]["kv_cache"]["window"]) == ("int8", 16)
