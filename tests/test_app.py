"""app.py end to end: `python app.py` in a subprocess, driven through gradio_client and through Debian's
chromium with playwright. Jobs run the real pipeline on the tiny Llama, and (marked builtin) on SmolLM2."""
import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import choose_local_folder, launch_browser, running_app

TOKEN = "hf_secretTokenThatMustNeverShow42"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """The app on a free port, its jobs under a temp folder, the Hub pointed at a closed local port."""
    tmp = tmp_path_factory.mktemp("app")
    with running_app(tmp) as running:
        yield running
    assert TOKEN not in (tmp / "app.log").read_text()


def test_the_app_starts_without_a_line_that_reads_like_a_failure(app):
    log = app["log"].read_text()
    assert "Running on local URL" in log
    assert [line for line in log.splitlines() if "Failed" in line or "Traceback" in line] == []


def test_browser_the_cost_shows_before_the_click_and_follows_the_ticks(app, tmp_path):
    """The built-in job's estimate is on the page as it opens, changes when a recipe is ticked, and the repo box
    says the Hub cannot be reached (the app's Hub is a closed port) while it keeps the typed id."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app["url"])
        cost = page.locator("#job-cost")
        expect(cost).to_contain_text("Estimate before you press Lower", timeout=120_000)
        expect(cost).to_contain_text("134M parameters, 1 recipe, full job")
        expect(cost).to_contain_text("fitted on zoo cells of 134M")
        page.get_by_label("xnnpack-fp32 — XNNPACK").check()
        expect(cost).to_contain_text("134M parameters, 2 recipes, full job", timeout=60_000)

        page.get_by_label("Hugging Face Hub repo").check()
        box = page.get_by_label("Hub repo id")
        box.click()
        box.press_sequentially("smollm", delay=50)
        expect(page.locator("#hub-note")).to_contain_text("cannot reach the Hub at http://127.0.0.1:", timeout=60_000)
        box.press("Enter")
        expect(box).to_have_value("smollm")
        expect(cost).to_contain_text("No estimate yet: cannot reach the Hub", timeout=60_000)
        page.screenshot(path=str(tmp_path / "cost.png"), full_page=True)
        shutil_copy(tmp_path / "cost.png")
        browser.close()


def tiny_args(tiny_llama_dir, **overrides):
    args = dict(source="Local path", hub_repo="", revision="", local_path=str(tiny_llama_dir), token="",
                recipes=["xnnpack-fp32"], prompt="the capital of France is", max_new_tokens=4, max_seq_len=64,
                group_size=32, options={})
    args.update(overrides)
    return args


def lower(client, **args):
    return client.predict(**args, api_name="/lower")


def test_lower_endpoint_with_gradio_client(app, tiny_llama_dir):
    from gradio_client import Client

    started = time.time()
    client = Client(app["url"], verbose=False)
    status, summary, chart, ops, op_filter, generations, files, push_recipe, decision, note = lower(
        client, **tiny_args(tiny_llama_dir, recipes=["xnnpack-fp32", "xnnpack-8da4w"], token=TOKEN))
    print(f"tiny job with two recipes: {time.time() - started:.1f} s")

    assert "2 of 2 recipes finished" in status
    assert [row[0] for row in summary["data"]] == ["xnnpack-fp32", "xnnpack-8da4w"]
    assert generations.index("eager-fp32") < generations.index("executorch-runtime")
    assert generations.count("executorch-runtime") == 2
    assert sorted(Path(f).name for f in files) == ["xnnpack-8da4w.zip", "xnnpack-fp32.zip"]
    spec = json.loads(decision["value"]["plot"])  # the Vega-Lite chart the page draws
    (points,) = spec["datasets"].values()
    assert [point["recipe"] for point in points] == ["xnnpack-fp32", "xnnpack-8da4w"]
    assert spec["layer"][0]["encoding"]["size"]["field"] == "pte_mb" and all(p["pte_mb"] > 0 for p in points)
    assert "each .pte on the ExecuTorch runtime" in note
    jobs = [p for p in app["jobs"].iterdir()]
    job = next(j for j in jobs if j.name in status)
    for recipe in ("xnnpack-fp32", "xnnpack-8da4w"):
        report = json.loads((job / recipe / "report.json").read_text())
        assert report["pte"]["bytes"] > 0 and not report["errors"]
        assert TOKEN not in (job / recipe / "report.json").read_text()
    assert {row["recipe"] for row in json.loads((job / "summary.json").read_text())} == {"xnnpack-fp32", "xnnpack-8da4w"}
    for downloaded in files:  # fetched over HTTP by the client: each the zip written in the job's folder
        assert Path(downloaded).read_bytes() == (job / Path(downloaded).name).read_bytes()


def test_three_concurrent_jobs_queue_visibly_and_never_mix(app, tiny_llama_dir):
    """Three users at once: with two jobs running at a time the third waits in a queue it can see (rank),
    every job gets its own folder, and each report holds its own user's prompt and recipe."""
    from gradio_client import Client
    from gradio_client.utils import Status

    users = [(f"user{i}", recipe, prompt) for i, (recipe, prompt) in enumerate([
        ("xnnpack-fp32", "the capital of France is"), ("xnnpack-8da4w", "hello world , how are you ?"),
        ("xnnpack-fp32", "what is the capital ?")])]
    started = time.time()
    jobs = {name: Client(app["url"], verbose=False).submit(
        **tiny_args(tiny_llama_dir, recipes=[recipe], prompt=prompt), api_name="/lower") for name, recipe, prompt in users}
    seen_queued = set()
    while not all(job.done() for job in jobs.values()):
        assert time.time() - started < 1800
        for name, job in jobs.items():
            status = job.status()
            if status.code == Status.IN_QUEUE and status.rank is not None:
                seen_queued.add(name)
        time.sleep(0.3)
    print(f"three concurrent tiny jobs: {time.time() - started:.1f} s, queued: {sorted(seen_queued)}")
    assert seen_queued, "no job was ever shown waiting in the queue"
    folders = {name: re.search(r"Job `(\w+)`", jobs[name].result()[0])[1] for name, _, _ in users}
    assert len(set(folders.values())) == 3
    for name, recipe, prompt in users:
        report = json.loads((app["jobs"] / folders[name] / "report.json").read_text())
        assert report["recipe"]["name"] == recipe
        assert {g["prompt"] for g in report["generations"]} == {prompt}
        assert (app["jobs"] / folders[name] / "model.pte").is_file()


def test_cancel_leaves_nothing_behind(app, tiny_llama_dir):
    from gradio_client import Client

    client = Client(app["url"], verbose=False)
    before = set(app["jobs"].iterdir())
    job = client.submit(**tiny_args(tiny_llama_dir, recipes=["xnnpack-fp32", "xnnpack-8da4w"]), api_name="/lower")
    deadline = time.time() + 120
    while not (set(app["jobs"].iterdir()) - before):  # the job folder exists once run() is about to start
        assert time.time() < deadline
        time.sleep(0.2)
    assert "Cancelling" in client.predict(api_name="/cancel")
    with pytest.raises(Exception, match="cancelled"):
        job.result(timeout=600)
    assert set(app["jobs"].iterdir()) == before


def test_bad_repo_is_an_error_and_the_app_stays_usable(app, tiny_llama_dir):
    from gradio_client import Client

    client = Client(app["url"], verbose=False)
    for repo, expected in (("../../etc", "not a valid Hugging Face repo id"), ("nobody/does-not-exist", "cannot reach the Hub")):
        with pytest.raises(Exception) as info:
            lower(client, **tiny_args(tiny_llama_dir, source="Hugging Face Hub repo", hub_repo=repo))
        assert expected in str(info.value) and "Traceback" not in str(info.value)
    status = lower(client, **tiny_args(tiny_llama_dir))[0]
    assert "1 of 1 recipes finished" in status


def test_an_algorithm_the_recipe_does_not_offer_is_refused_as_on_the_cli(app, tiny_llama_dir):
    from gradio_client import Client

    client = Client(app["url"], verbose=False)
    before = set(app["jobs"].iterdir())
    with pytest.raises(Exception) as info:
        lower(client, **tiny_args(tiny_llama_dir, recipes=["xnnpack-8da4w"], options={"quant_algorithm": "spinquant-r4"}))
    assert re.search(r"quant algorithm 'spinquant-r4' is not offered for 8da4w \(.*online Hadamard.*\); choose one of: awq, hqq, minmax",
                     str(info.value))
    assert set(app["jobs"].iterdir()) == before


def test_settings_the_model_cannot_hold_are_refused_before_the_click_and_at_it(app, tiny_llama_dir):
    """A KV window holding the tiny Llama's whole 2048-token context, a context beyond it and a prompt longer than
    the context: the estimate says so on the page, and Lower refuses with the CLI's message, writing nothing."""
    from gradio_client import Client

    from app import LOCAL, ModelFields, job_cost_text

    folder = ModelFields(LOCAL, local_path=str(tiny_llama_dir))
    panel = job_cost_text(folder, ["xnnpack-8da4w"], {"kv_cache_window": 2044}, 64, False)
    assert "This job would be refused**: a KV cache window of 2044 tokens" in panel
    panel = job_cost_text(folder, ["xnnpack-8da4w"], {}, 4096, False)
    assert "This job would be refused**: max context 4096 is beyond this model's limit of 2048" in panel

    client = Client(app["url"], verbose=False)
    before = set(app["jobs"].iterdir())
    refusals = ((dict(recipes=["xnnpack-8da4w"], options={"kv_cache_window": 2044}), "the ring never wraps"),
                (dict(max_seq_len=4096), "beyond this model's limit of 2048"),
                (dict(prompt="hello world " * 40, max_seq_len=32), "does not fit in the max context of 32"))
    for overrides, expected in refusals:
        with pytest.raises(Exception) as info:
            lower(client, **tiny_args(tiny_llama_dir, **overrides))
        assert expected in str(info.value) and "Traceback" not in str(info.value)
    assert set(app["jobs"].iterdir()) == before


def test_browser_error_stays_on_the_page_after_its_toast_then_a_job_succeeds(app, tiny_llama_dir, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app["url"])
        page.get_by_label("Hugging Face Hub repo").check()
        page.get_by_label("Hub repo id").fill("../../etc/passwd")
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.locator(".toast-item").first).to_be_visible(timeout=60_000)
        expect(page.locator(".toast-item")).to_have_count(0, timeout=60_000)
        expect(page.locator("#status")).to_contain_text("'../../etc/passwd' is not a valid Hugging Face repo id")
        expect(page.get_by_text("Error", exact=True)).to_have_count(0)  # no panel with a bare badge instead
        assert "Traceback" not in page.content()
        page.screenshot(path=str(tmp_path / "error.png"), full_page=True)
        shutil_copy(tmp_path / "error.png")

        choose_local_folder(page, tiny_llama_dir)
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.locator("#generations")).to_contain_text("executorch-runtime", timeout=600_000)
        expect(page.locator("#summary-table")).to_contain_text("xnnpack-8da4w")
        expect(page.locator("#status")).to_contain_text("1 of 1 recipes finished")
        expect(page.locator("#status")).not_to_contain_text("not a valid")

        page.get_by_text("Push to Hub", exact=True).first.click()
        page.get_by_label("Repo (name, or owner/name; created if missing)").fill("tiny-xnnpack")
        page.get_by_role("button", name="Push to Hub", exact=True).last.click()
        expect(page.locator(".toast-item").first).to_be_visible(timeout=60_000)
        expect(page.locator(".toast-item")).to_have_count(0, timeout=60_000)
        expect(page.locator("#push-status")).to_contain_text("pushing needs a Hugging Face token")
        expect(page.get_by_text("Error", exact=True)).to_have_count(0)
        page.screenshot(path=str(tmp_path / "tiny.png"), full_page=True)
        shutil_copy(tmp_path / "tiny.png")
        browser.close()


def test_browser_a_ticked_core_ml_recipe_alone_runs_exactly_that_recipe(app, tiny_llama_dir, tmp_path):
    """The recipes are one list grouped by backend, the one whose .pte runs here first: what is ticked runs."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app["url"])
        groups = page.locator("[id^=recipes-]")
        expect(groups.first).to_have_id("recipes-xnnpack")
        expect(groups.first).to_contain_text("Runs here")
        expect(page.locator("#recipes-coreml")).to_contain_text("Not here: Core ML programs run only on Apple")
        expect(page.locator("#summary-table")).to_be_hidden()  # no empty placeholder table before a job

        choose_local_folder(page, tiny_llama_dir)
        page.get_by_label("xnnpack-8da4w — XNNPACK").uncheck()
        page.get_by_label("coreml-int4 — Core ML, int4 weights (group 32), fp16 compute").check()
        page.get_by_text("Advanced", exact=True).click()
        page.get_by_label("Lower only: write the .pte").check()
        before = set(app["jobs"].iterdir())
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.locator("#status")).to_contain_text("1 of 1 recipes finished", timeout=600_000)
        expect(page.locator("#summary-table")).to_contain_text("coreml-int4")
        expect(page.locator("#summary-table")).not_to_contain_text("xnnpack")
        page.screenshot(path=str(tmp_path / "coreml.png"), full_page=True)
        shutil_copy(tmp_path / "coreml.png")
        browser.close()
    (job,) = set(app["jobs"].iterdir()) - before
    report = json.loads((job / "report.json").read_text())
    assert report["recipe"]["name"] == "coreml-int4" and not report["errors"]
    assert report["delegation"]["delegated_nodes"] > 0 and (job / "model.pte").is_file()


def test_browser_an_algorithm_and_the_layer_map_reach_the_report_and_its_chart(app, tiny_llama_dir, tmp_path):
    """minmax (not 8da4w's default) and the per-layer map from the Advanced controls: the report records the
    algorithm, and the SQNR chart shows the recipe's line with the engine that measured it."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.goto(app["url"])
        choose_local_folder(page, tiny_llama_dir)
        page.get_by_text("Advanced", exact=True).click()
        page.get_by_label("Quantization algorithm").click()
        page.get_by_role("option", name=re.compile(r"^minmax — ")).click()
        page.get_by_label("Per-layer error map").check()
        expect(page.locator("#sqnr-chart")).to_be_hidden()
        before = set(app["jobs"].iterdir())
        page.get_by_role("button", name="Lower", exact=True).click()
        expect(page.locator("#status")).to_contain_text("1 of 1 recipes finished", timeout=600_000)
        engines = page.locator("#layer-map-engines")
        expect(engines).to_contain_text("xnnpack-8da4w: executorch-runtime, ExecuTorch intermediate_output_tap",
                                        timeout=60_000)
        chart = page.locator("#sqnr-chart")
        expect(chart).to_contain_text("SQNR per layer (dB) · executorch-runtime")
        expect(chart).to_contain_text("xnnpack-8da4w")  # the line's legend entry
        page.screenshot(path=str(tmp_path / "layer-map.png"), full_page=True)
        shutil_copy(tmp_path / "layer-map.png")
        browser.close()
    (job,) = set(app["jobs"].iterdir()) - before
    report = json.loads((job / "report.json").read_text())
    assert report["recipe"]["options"]["quant_algorithm"] == "minmax"
    assert report["quantization"]["algorithm"] == "minmax"
    layers = report["fidelity"]["layers"]
    assert layers["engine"] == "executorch-runtime" and len(layers["layers"]) == json.loads(
        (tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.builtin
@pytest.mark.timeout(3600)
def test_browser_lowers_the_builtin_model(builtin_run):
    """The session's built-in job (tests/conftest.py: the app's default job, xnnpack-fp32 ticked too, clicked
    in chromium): the page shows both recipes' results, ExecuTorch's LLM runner answering beside eager fp32."""
    _job, _reports, shown = builtin_run
    print(f"built-in xnnpack-fp32 + xnnpack-8da4w through the browser: {shown['seconds']} s")
    assert "xnnpack-8da4w" in shown["summary"] and "xnnpack-fp32" in shown["summary"]
    # every cell a person reads is a figure, a name or a dash: no object, None, NaN or raw dict
    raw = ("[object", "None", "nan", "{")
    assert not [bad for bad in raw if bad in shown["summary"]], shown["summary"]
    cells = [c for c in shown["summary_cells"] if c.strip()]  # the page's table also holds empty layout cells
    assert not [c for c in cells if any(bad in c for bad in raw)]
    assert "perplexity vs fp32 (×)" in shown["summary"] and "in delegates (% of decode time)" in shown["summary"]
    assert shown["decision_points"] == 2, shown["decision_chart"]
    assert sorted(shown["decision_names"]) == ["xnnpack-8da4w", "xnnpack-fp32"]
    # the estimate made before the click stands beside what the job measured
    assert "estimated time (s)" in shown["summary"] and "estimated peak RSS (GB)" in shown["summary"]
    for report in _reports.values():
        timings = report["timings_s"]
        assert timings["estimate"]["total"] > 0 and timings["total"] >= timings["export"] + timings["lower"]
    text = shown["generations"]
    # each recipe's column shows ExecuTorch's LLM runner on the folder's files
    assert "eager-fp32" in text and text.index("eager-fp32") < text.index("executorch-llm-runner")
    assert "Paris" in text.split("xnnpack-8da4w", 1)[1]
    shutil_copy(shown["screenshot"])


@pytest.mark.builtin
def test_the_downloaded_zip_is_the_folder_the_llm_runner_loads(builtin_run, tmp_path):
    """The zip a person downloads from the page for a recipe (clicked in chromium), unzipped: ExecuTorch's
    TextLLMRunner loads its .pte with its tokenizer and answers the default prompt."""
    import zipfile

    from transformers import AutoTokenizer

    from recipes.running.generate import DEFAULT_PROMPT
    from recipes.running.llm_runner import generate_with_runner

    job, reports, shown = builtin_run
    assert shown["zip"].name == "xnnpack-8da4w.zip"
    assert shown["zip"].read_bytes() == (job / "xnnpack-8da4w.zip").read_bytes()  # the zip written in the job
    with zipfile.ZipFile(shown["zip"]) as archive:
        archive.extractall(tmp_path)
    assert {"model.pte", "tokenizer.json", "tokenizer_config.json", "report.json", "README.md", "model.etdump"} <= {
        p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "report.json").read_text()) == reports["xnnpack-8da4w"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    answer = generate_with_runner(tmp_path / "model.pte", tmp_path / "tokenizer.json", tokenizer, DEFAULT_PROMPT, 16,
                                  eos_token_ids=reports["xnnpack-8da4w"]["llm_metadata"]["get_eos_ids"])
    assert "Paris" in answer.text and answer.engine == "executorch-llm-runner"


def shutil_copy(png: Path) -> None:
    """Keep the last screenshot where a person can look at it after the run (optional)."""
    target = os.environ.get("LOWERBENCH_SCREENSHOT_DIR")
    if target:
        import shutil

        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(target) / png.name)


def test_model_card_describes_the_recipe(tiny_fp32_run):
    from dataclasses import replace

    from recipes.output.publish import model_card
    from recipes.output.report import Fidelity, MixedPrecision, QuantCalibration, Quantization

    _, report = tiny_fp32_run
    card = model_card(replace(report, fidelity=Fidelity(top1_agreement_percent=97.0)))
    assert card.startswith("---\nlibrary_name: executorch\n")
    assert "xnnpack-fp32" in card and "## Delegation" in card and "% delegated" in card
    assert "top1_agreement" in card and "torch " in card and "executorch " in card
    assert report.pte.sha256 in card
    assert "TextLLMRunner(\"model.pte\", \"tokenizer.json\")" in card and "llama_main --model_path=model.pte" in card
    assert "adb push tokenizer.json" in card and "etLLM" in card and "get_max_seq_len" in card
    assert "Kept at 8 bits" not in card and "calibrated on" not in card
    calibration = QuantCalibration(text="quant/calibration_text.txt (Alice)", tokens=512)
    card = model_card(replace(report, quantization=Quantization(algorithm="awq", calibration=calibration)))
    assert "Quantization algorithm `awq`, calibrated on 512 tokens of quant/calibration_text.txt (Alice)." in card
    mixed = MixedPrecision(units_8bit=["model.layers.1.mlp.down_proj", "lm_head"], extra_bytes_per_token=1_500_000)
    quantization = replace(report.quantization or Quantization(), mixed_precision=mixed)
    card = model_card(replace(report, quantization=quantization))
    assert "+1.50 MB of weights per token: layer 1 down_proj and the output layer." in card
    chat = model_card(report, chat_template="{{ '<|im_start|>' }}")
    assert "```jinja\n{{ '<|im_start|>' }}\n```" in chat and "`QWEN_3`" in chat and "smollm3-model.pte" in chat


def test_push_refuses_cleanly_without_a_token(tiny_fp32_run):
    from models.errors import UserFacingError
    from recipes.output.publish import push_to_hub

    with pytest.raises(UserFacingError, match="token"):
        push_to_hub(tiny_fp32_run[0], "me/tiny", token=None)


def test_push_to_hub_creates_the_repo_and_round_trips(hub, tiny_fp32_run, tmp_path):
    from huggingface_hub import hf_hub_download

    from models.errors import UserFacingError
    from recipes.output.publish import push_to_hub
    from tests.conftest import BAD_TOKEN, GOOD_TOKEN

    hub.users[GOOD_TOKEN] = "tester"
    folder, report = tiny_fp32_run
    url = push_to_hub(folder, "tiny-xnnpack", token=GOOD_TOKEN)
    assert url.startswith(hub.endpoint + "/tester/tiny-xnnpack/commit/")
    assert hub.commits[-1][0] == "tester/tiny-xnnpack"
    assert sorted(hub.commits[-1][2]) == ["README.md", "model.pte", "report.json", "tokenizer.json",
                                          "tokenizer_config.json"]
    pte = hf_hub_download("tester/tiny-xnnpack", "model.pte", token=GOOD_TOKEN, cache_dir=tmp_path)
    assert Path(pte).read_bytes() == (folder / "model.pte").read_bytes()

    push_to_hub(folder, "tester/tiny-xnnpack", token=GOOD_TOKEN)  # an existing repo gets a new commit
    assert len([c for c in hub.commits if c[0] == "tester/tiny-xnnpack"]) == 2
    for token, expected in ((BAD_TOKEN, "invalid or expired"), (GOOD_TOKEN, "may not write")):
        with pytest.raises(UserFacingError, match=expected) as info:
            push_to_hub(folder, "org/tiny-llama", token=token)
        assert token not in str(info.value)
