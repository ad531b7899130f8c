import contextlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.process import thread_policy

ROOT = Path(__file__).resolve().parent.parent

# The suite runs under the thread policy Lowerbench's own processes use (thread_policy.py): OpenMP's
# default must be set before anything loads torch, then torch's own threads go back to one per core, or to
# each parallel worker's share of the cores (the processes it starts inherit the share).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault(thread_policy.CORES_ENV, str(max(1, thread_policy.physical_cores() // _workers)))
thread_policy.limit_openmp_default()
thread_policy.torch_threads()

# The suite runs on two pytest-xdist workers (pytest.ini). Tests sharing an expensive fixture stay on one
# worker, so it is computed once: the built-in model's run, and test_matrix.py's Ray cluster. Workers take
# tests in collection order, so the longest go first and the quick ones fill in at the end: the built-in
# group (the longest single chain), then the other built-in-model tests and shared-fixture groups.
SHARED_FIXTURE_GROUPS = {"builtin_run": "builtin", "builtin_8da4w_run": "builtin", "builtin_fp32_run": "builtin",
                         "ray_cluster": "ray", "ray_head": "ray", "builtin_int8_ring_folder": "kv-cache"}


# The fast tier (`pytest -m "not slow"`) leaves out every test that exports, lowers or runs a job: the built-in
# model's, the browser's, Ray's, and any whose own code or fixtures make a program.
SLOW_FIXTURES = {"builtin_run", "builtin_8da4w_run", "builtin_fp32_run", "builtin_int8_ring_folder", "ray_cluster",
                 "ray_head", "runner_llama_run", "tiny_fp32_run", "tiny_fp32_lowered", "tiny_qnn_16a4w"}
SLOW_CALLS = re.compile(r"\b(run_main|run_cli|running_app|launch_browser|prepare_and_lower|lower_for_backend|"
                        r"lower_to_pte|export_program|export_methods|run|run_job|subprocess\.run|Popen)\(")


def makes_a_program(function) -> bool:
    try:
        return bool(function and SLOW_CALLS.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


# Modules whose tests, through helpers of their own, lower or run programs nearly throughout.
SLOW_MODULES = {"test_app", "test_builtin", "test_coreml", "test_deploy", "test_kv_cache", "test_matrix",
                "test_matrix_cluster", "test_profile", "test_qnn", "test_qnn_hybrid", "test_quiet_run", "test_spine", "test_static",
                "test_vulkan", "test_weights_file", "test_xnnpack_patches", "test_zoo_app"}


def is_slow(item) -> bool:
    if item.get_closest_marker("builtin") or SLOW_FIXTURES & set(item.fixturenames):
        return True
    if item.module.__name__.rpartition(".")[2] in SLOW_MODULES:
        return True
    fixtures = [definition.func for name in item.fixturenames
                for definition in item._fixtureinfo.name2fixturedefs.get(name, ())
                if not definition.func.__module__.startswith(("_pytest", "pytest"))]
    return any(makes_a_program(function) for function in [getattr(item, "function", None), *fixtures])


def shared_program_fixture(item) -> str | None:
    """The first module- or session-wide fixture of the item that makes a program, as `module.name`: the tests that
    share it stay on one worker, or each worker would make it again."""
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            module = definition.func.__module__
            if definition.scope not in ("module", "session") or module.startswith(("_pytest", "pytest")):
                continue
            if (name in SLOW_FIXTURES or makes_a_program(definition.func)
                    or (definition.scope == "module" and module.rpartition(".")[2] in SLOW_MODULES)):
                return f"{module}.{name}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
        # one group per test: xdist makes a test of two groups a group of its own
        group = next((SHARED_FIXTURE_GROUPS[name] for name in item.fixturenames if name in SHARED_FIXTURE_GROUPS),
                     None) or shared_program_fixture(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: ("builtin_run" not in item.fixturenames,
                                 item.get_closest_marker("builtin") is None
                                 and item.get_closest_marker("xdist_group") is None))


GOOD_TOKEN = "hf_goodTokenWithGatedAccess0123"
OTHER_TOKEN = "hf_validTokenWithoutGatedAccess9"
BAD_TOKEN = "hf_expiredOrRevokedToken4567890"


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    sentences = ["the capital of France is Paris .", "hello world , how are you ?", "what is the capital ?"]
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _random_llama_dir(tmp_path_factory, name: str, hidden: int, intermediate: int, layers: int):
    """A random Llama (seed 0) with the tiny tokenizer, saved as a Hugging Face folder (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp(name)
    tokenizer = _tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer with a ChatML chat template, the kind ExecuTorch's LLM runner loads
    (SmolLM2's and Llama 3's are byte-level BPE). Trained on ASCII only: every token is whole UTF-8 text,
    which the runner's Python token callback needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sentences = ["the capital of France is Paris .\n", "hello world , how are you ?\n", "what is the capital ?\n",
                 "user\nassistant\nsystem\n"]
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
    tok.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=120, special_tokens=specials))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def runner_llama_dir(tmp_path_factory):
    """A random 2-layer Llama (seed 1) with the byte-level tokenizer and a Llama-3-style generation_config.json whose
    eos_token_id lists three stop ids (</s>, <|im_end|>, <|eot|>)."""
    import json

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("runner-llama")
    tokenizer = _byte_level_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(1)  # seed 0 answers the test prompt with one token over and over
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    stops = tokenizer.convert_tokens_to_ids(["</s>", "<|im_end|>", "<|eot|>"])
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": stops}))
    return folder


def _fp32_run(tmp_path_factory, name: str, model_dir, prompt: str, max_new_tokens: int):
    """`model_dir` through `run()` with xnnpack-fp32 at a context of 64: (recipe folder, report)."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp(name)
    summary = run(RunRequest(recipes=["xnnpack-fp32"], out_dir=out, model=str(model_dir),
                             prompt=prompt, max_new_tokens=max_new_tokens, max_seq_len=64))
    return out, summary.recipes[0]


@pytest.fixture(scope="session")
def runner_llama_run(runner_llama_dir, tmp_path_factory):
    """runner_llama_dir through `run()` with xnnpack-fp32: a folder the LLM runner takes."""
    return _fp32_run(tmp_path_factory, "runner-llama-run", runner_llama_dir, "what is the capital of France ?", 8)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random 2-layer Llama (hidden 64, MLP 128)."""
    return _random_llama_dir(tmp_path_factory, "tiny-llama", hidden=64, intermediate=128, layers=2)


@pytest.fixture(scope="session")
def wide_llama_dir(tmp_path_factory):
    """A random 1-layer Llama as wide as real ones in its linears (256 -> 512 outputs): wider than 256 outputs is
    where QNN 2.47 stops preparing block-quantized FullyConnected ops."""
    return _random_llama_dir(tmp_path_factory, "wide-llama", hidden=256, intermediate=512, layers=1)


@pytest.fixture(scope="session")
def hub_repo_dirs(tiny_llama_dir, tmp_path_factory):
    """Folders served as Hub repos: the tiny Llama plus files a download must skip, a pickle-only copy,
    and a repo without config.json."""
    import torch
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("hub-repos")
    full = root / "full"
    shutil.copytree(tiny_llama_dir, full)
    (full / "README.md").write_text("# tiny llama\n")
    (full / "training_args.bin").write_bytes(b"not needed")
    (full / "original").mkdir()
    (full / "original" / "consolidated.00.pth").write_bytes(b"meta format, not needed")
    (full / "onnx").mkdir()
    (full / "onnx" / "model.safetensors").write_bytes(b"onnx export, not needed")

    pickle_only = root / "pickle-only"
    shutil.copytree(tiny_llama_dir, pickle_only, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(tiny_llama_dir / "model.safetensors"), pickle_only / "pytorch_model.bin")

    no_config = root / "no-config"
    no_config.mkdir()
    shutil.copy(tiny_llama_dir / "model.safetensors", no_config)
    return {"full": full, "pickle-only": pickle_only, "no-config": no_config}


@pytest.fixture
def hub(hub_repo_dirs, tmp_path, monkeypatch):
    """A running HubServer with the test repos, and huggingface_hub pointed at it with an empty cache.
    huggingface_hub reads HF_ENDPOINT / HF_HOME into `constants` at import, so those are patched too."""
    from huggingface_hub import constants

    from tests.hub_server import HubServer

    server = HubServer(tokens=[GOOD_TOKEN, OTHER_TOKEN])
    server.add_repo("org/tiny-llama", hub_repo_dirs["full"], branches=("main", "v1"))
    server.add_repo("org/gated-llama", hub_repo_dirs["full"], gated_for=[GOOD_TOKEN])
    server.add_repo("org/pickle-llama", hub_repo_dirs["pickle-only"])
    server.add_repo("org/no-config", hub_repo_dirs["no-config"])
    server.add_repo("org/huge-llama", hub_repo_dirs["full"], reported_sizes={"model.safetensors": 10 * 1024**4})
    endpoint = server.start()

    home = tmp_path / "hf-home"
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_llama_dir):
    from models.sources.checkpoint import load_checkpoint

    return load_checkpoint(str(tiny_llama_dir))


@pytest.fixture(scope="session")
def tiny_fp32_lowered(tiny_checkpoint):
    """The tiny Llama exported and lowered once with xnnpack-fp32, shared by the tests that read it."""
    from recipes.pipeline.prepare import RecipeJob, prepare_and_lower
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-fp32")
    made = prepare_and_lower(RecipeJob(recipe, {}, tiny_checkpoint, 64))
    return made.module, made.lowered, recipe


def run_cli(*args, timeout=3000, env: dict | None = None):
    """`python -m recipes ...` (or `python -m zoo matrix ...`) in a subprocess, as a user or CI script would run
    it; env: variables to add."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-m", "zoo" if args[0] == "matrix" else "recipes", *args], cwd=root, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_main(*args):
    """`python -m recipes ...` (or `python -m zoo matrix ...`) in this process: the same main() without a new
    interpreter's imports, for refusals that happen before any work. (returncode, stdout, stderr) as run_cli
    gives them."""
    import io
    import types
    from contextlib import redirect_stderr, redirect_stdout

    from recipes.__main__ import main as recipes_main
    from zoo.__main__ import main as zoo_main

    main = zoo_main if args[0] == "matrix" else recipes_main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's refusals
            code = exit_.code
    return types.SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


# The built-in model's end-to-end recipes in one job: one load and one fp32 reference for both. These are
# the recipes whose .pte runs here (runtime, LLM runner, fidelity); the other backends' lowerings are checked
# per layer on the tiny Llama.
BUILTIN_RECIPES = ["xnnpack-fp32", "xnnpack-8da4w"]


CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_app(tmp: Path):
    """`python app.py` on a free port, its jobs under tmp/jobs, the Hub pointed at a closed local port:
    {url, jobs, log}."""
    import socket
    import time

    port = free_port()
    env = {**os.environ, "LOWERBENCH_JOBS_DIR": str(tmp / "jobs"), "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
           "HF_HOME": str(tmp / "hf-home"), "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SPACE_ID"):
        env.pop(name, None)
    with open(tmp / "app.log", "w") as log:
        process = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 180
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    assert process.poll() is None, (tmp / "app.log").read_text()[-3000:]
                    assert time.time() < deadline, "the app did not start within 180 s"
                    time.sleep(0.5)
            yield {"url": f"http://127.0.0.1:{port}/", "jobs": tmp / "jobs", "log": tmp / "app.log"}
        finally:
            process.terminate()
            process.wait(timeout=30)


def choose_local_folder(page, folder) -> None:
    """On the app's page: the Local path source, with this folder in its box."""
    page.get_by_label("Local path", exact=True).check()
    page.get_by_label("Local path (Hugging Face folder or .gguf)").fill(str(folder))


def launch_browser(playwright):
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("Debian chromium is not installed (bash setup.sh --test)")
    return playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)


@pytest.fixture(scope="session")
def builtin_run(tmp_path_factory):
    """The built-in SmolLM2-135M through BUILTIN_RECIPES once per session, as a user runs it: the app's default
    job (the built-in model, xnnpack-8da4w) with xnnpack-fp32 ticked too, clicked in chromium. The app runs
    the same run() as the CLI. (job folder, {recipe: report}, {what the page showed, seconds taken})."""
    import json
    import time

    from playwright.sync_api import expect, sync_playwright

    tmp = tmp_path_factory.mktemp("builtin")
    with running_app(tmp) as app, sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app["url"])
        expect(page.get_by_label("Built-in SmolLM2-135M-Instruct")).to_be_checked()
        expect(page.get_by_label("xnnpack-8da4w — XNNPACK")).to_be_checked()
        page.get_by_label("xnnpack-fp32 — XNNPACK").check()
        started = time.time()
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.get_by_text("loading the checkpoint").first).to_be_visible(timeout=120_000)
        expect(page.locator("#status")).to_contain_text(f"{len(BUILTIN_RECIPES)} of {len(BUILTIN_RECIPES)} recipes "
                                                        "finished", timeout=1_800_000)
        shown = {"seconds": round(time.time() - started, 1), "generations": page.locator("#generations").inner_text(),
                 "summary": page.locator("#summary-table").inner_text(), "status": page.locator("#status").inner_text()}
        # what a person reads: every summary cell, the decision chart's points
        shown["summary_cells"] = page.locator("#summary-table tbody td").all_inner_texts()
        expect(page.locator("#decision-chart g.mark-symbol path").first).to_be_attached(timeout=60_000)
        # the data's points only: Vega draws the legend's swatches as symbols too (role-legend-symbol)
        shown["decision_points"] = page.locator("#decision-chart g.mark-symbol.role-mark path").count()
        shown["decision_chart"] = page.locator("#decision-chart").inner_text()
        shown["decision_names"] = page.locator("#decision-chart g.mark-text.role-mark text").all_text_contents()
        page.screenshot(path=str(tmp / "builtin.png"), full_page=True)
        shown["screenshot"] = tmp / "builtin.png"
        with page.expect_download() as download:  # the recipe's zip, as a person clicks it in the downloads list
            page.locator('#downloads a[download="xnnpack-8da4w.zip"]').click()
        shown["zip"] = tmp / "clicked" / download.value.suggested_filename
        download.value.save_as(shown["zip"])
        browser.close()
    (job,) = list(app["jobs"].iterdir())
    reports = {recipe: json.loads((job / recipe / "report.json").read_text()) for recipe in BUILTIN_RECIPES}
    return job, reports, shown


@pytest.fixture(scope="session")
def builtin_8da4w_run(builtin_run):
    out, reports, result = builtin_run
    return out / "xnnpack-8da4w", reports["xnnpack-8da4w"], result


@pytest.fixture(scope="session")
def tiny_fp32_run(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama through `run()` with xnnpack-fp32: a finished recipe folder (model.pte + report.json)."""
    return _fp32_run(tmp_path_factory, "tiny-fp32-run", tiny_llama_dir, "the capital of France is", 4)


@pytest.fixture(scope="session")
def builtin_fp32_run(builtin_run):
    """xnnpack-fp32 on the built-in model (its report carries fidelity)."""
    out, reports, result = builtin_run
    return out / "xnnpack-fp32", reports["xnnpack-fp32"], result


# The built-in model's ring program: an int8 KV cache, a ring of this many recent tokens (and 4 sinks).
BUILTIN_RING_WINDOW = 64


@pytest.fixture(scope="session")
def builtin_int8_ring_folder(tmp_path_factory):
    """The built-in SmolLM2-135M as xnnpack-8da4w (HQQ qparams: no calibration search) with an int8 KV cache in a
    ring of BUILTIN_RING_WINDOW recent tokens, export-only through `run()`: (recipe folder, report)."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("builtin-int8-ring")
    options = {"quant_algorithm": "hqq", "kv_cache": "int8", "kv_cache_window": BUILTIN_RING_WINDOW}
    summary = run(RunRequest(recipes=["xnnpack-8da4w"], out_dir=out, options=options, generate=False, profile=False))
    return out, summary.recipes[0]


@pytest.fixture(scope="session")
def tiny_qnn_16a4w(tiny_checkpoint):
    """The tiny Llama through the qnn-16a4w PT2E scheme (QnnQuantizer, calibrated on the built-in
    prompts): (checkpoint, quantized one-token ExportedProgram, converted module that simulates it).
    Needs no QNN library."""
    from models.llama import build_exportable
    from quant.calibration import calibration_inputs
    from recipes.lowering.lower import export_program
    from recipes.registry import get_recipe
    from recipes.pipeline.prepare import quantize_exported

    recipe = get_recipe("qnn-16a4w")
    module = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, recipe.export_options(32))
    program = export_program(module, 32, strict=recipe.backend.strict_export)
    inputs = calibration_inputs(tiny_checkpoint.tokenizer, 32)
    return (tiny_checkpoint, *quantize_exported(recipe, program, inputs, dict(recipe.options), 32))
