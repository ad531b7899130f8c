"""Lowerbench in the browser: a thin Gradio layer over `recipes.pipeline.run.run` (the same function the CLI calls).
Each job runs in its own process and folder (ui/jobs.py).

    python app.py [--host 127.0.0.1] [--port 7860]

Environment: those of ui/jobs.py (jobs folder, age and size caps), LOWERBENCH_CONCURRENCY (jobs at once,
default 2), LOWERBENCH_ALLOW_LOCAL_PATHS (default 1, or 0 on a Space).
"""

import argparse
import html
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# Only modules that leave torch unloaded are imported here: main() must call thread_policy.limit_openmp_default()
# before torch loads, so the modules that load it are imported inside the functions that use them.
from models.errors import UserFacingError
from models.sources.hub import check_repo_id
from models.sources.hub_search import MIN_CHARACTERS, suggest_repos
from quant.calibration_file import MAX_CALIBRATION_FILE_BYTES
from recipes.process import thread_policy
from recipes.process.dependency_noise import silence_dependency_noise
from ui.jobs import cancel_job, job_folder, jobs_root, run_job
from recipes.output.profile_view import decode_bars, profile_rows, profile_summary, profile_table, read_reports
from recipes.output.publish import push_to_hub, zip_recipe_folder
from recipes.output.report import JobSummary, Report, RunnerGeneration
from recipes.output.summary import decision_chart, summary_rows
from zoo import entries as zoo

ROOT = Path(__file__).resolve().parent
BUILTIN, HUB, LOCAL = "Built-in SmolLM2-135M-Instruct", "Hugging Face Hub repo", "Local path"
ON_SPACE = bool(os.environ.get("SPACE_ID"))


def backends() -> dict[str, list]:
    """Recipes grouped by backend name, in the registry's order: the backends whose .pte runs here first."""
    # loads torch, which main() lets load only after the thread policy is set
    from recipes.registry import RECIPES, load_backends

    registry = load_backends()
    return {name: [r for r in RECIPES.values() if r.backend is backend]
            for name, backend in registry.backends.items() if any(r.backend is backend for r in RECIPES.values())}


def where_it_runs(backend) -> str:
    """One line under a backend's recipes: where its .pte runs, and whether that is here."""
    why = backend.cannot_run_here()
    if why is None:
        return f"Runs here: {backend.runs_on}; its column shows the .pte's own output."
    return f"Its .pte runs on {backend.runs_on}. Not here: {why}"


def recipe_label(recipe) -> str:
    return f"{recipe.name} — {recipe.description}"


def backend_option_defaults(grouped: dict[str, list]) -> dict[tuple[str, str], object]:
    """(backend, option) -> default, for recipe options other than the shared group size."""
    found = {}
    for backend, recipes in grouped.items():
        for recipe in recipes:
            for key, value in recipe.options.items():
                if key != "group_size":
                    found.setdefault((backend, key), value)
    return found


def choose_model(source: str, hub_repo: str, local_path: str) -> str | None:
    if source == HUB:
        if not (hub_repo or "").strip():
            raise UserFacingError("type a Hub repo id, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'.")
        check_repo_id(hub_repo.strip())  # a Hub id only: '../x' must not reach the local-path branch
        return hub_repo.strip()
    if source == LOCAL:
        if os.environ.get("LOWERBENCH_ALLOW_LOCAL_PATHS", "0" if ON_SPACE else "1") != "1":
            raise UserFacingError("local paths are disabled on this server; use the built-in model or a Hub repo.")
        if not (local_path or "").strip():
            raise UserFacingError("type the path of a local Hugging Face folder or .gguf file.")
        return local_path.strip()
    return None


def choose_adapter(adapter: str) -> str | None:
    """The Advanced tab's LoRA adapter: a Hub repo id, or a local folder where local paths are allowed."""
    adapter = (adapter or "").strip()
    if not adapter:
        return None
    if os.environ.get("LOWERBENCH_ALLOW_LOCAL_PATHS", "0" if ON_SPACE else "1") != "1":
        check_repo_id(adapter)  # a Hub id only: a path must not reach the local-folder branch
        if Path(adapter).expanduser().exists():
            raise UserFacingError("local paths are disabled on this server; give the adapter's Hub repo id.")
    return adapter


def op_rows(summary: JobSummary) -> list[dict]:
    rows = []
    for report in summary.recipes:
        for op in report.delegation.ops if report.delegation else []:
            rows.append({"backend": report.recipe.backend, "recipe": report.recipe.name, **op.to_dict()})
    return rows


def filter_ops(rows: list[dict], choice: str):
    import pandas as pd

    kept = [r for r in rows or [] if choice in (None, "", "all", r["backend"], r["recipe"])]
    return pd.DataFrame(kept, columns=["backend", "recipe", "op", "delegated", "non_delegated"])


def delegation_frame(summary: JobSummary):
    import pandas as pd

    long = []
    for report in summary.recipes:
        delegation = report.delegation
        for kind, nodes in (("delegated", delegation.delegated_nodes if delegation else 0),
                            ("non-delegated", delegation.non_delegated_nodes if delegation else 0)):
            long.append({"recipe": report.recipe.name, "nodes": nodes or 0, "kind": kind})
    return pd.DataFrame(long, columns=["recipe", "nodes", "kind"])


DECISION_COLUMNS = ["recipe", "x", "perplexity_ratio", "pte_mb", "label"]


def decision_plot(summary: JobSummary):
    """Speed (or bytes read per token) against fidelity: a point per recipe, its area by .pte size, its name beside
    it and its engine in the legend; and the line saying what measured the axes."""
    import altair as alt
    import gradio as gr
    import pandas as pd

    chart = decision_chart(summary)
    frame = pd.DataFrame(chart.points, columns=DECISION_COLUMNS)
    axes = alt.Chart(frame).encode(
        x=alt.X("x:Q", title=chart.x_title, scale=alt.Scale(zero=False, nice=True)),
        y=alt.Y("perplexity_ratio:Q", title="perplexity vs fp32 (×)", scale=alt.Scale(zero=False, nice=True)))
    points = axes.mark_circle(opacity=0.75).encode(
        size=alt.Size("pte_mb:Q", title=".pte (MB)", scale=alt.Scale(range=[80, 1600])),
        color=alt.Color("label:N", title="recipe · engine"),
        tooltip=[alt.Tooltip("label:N", title="recipe · engine"), alt.Tooltip("x:Q", title=chart.x_title),
                 alt.Tooltip("perplexity_ratio:Q", title="perplexity vs fp32 (×)"),
                 alt.Tooltip("pte_mb:Q", title=".pte (MB)")])
    names = axes.mark_text(align="left", dx=14, dy=-10).encode(text="recipe:N")
    # Vega draws on a canvas unless told otherwise; SVG keeps each point an element a browser (and a test) can read
    plot = (points + names).properties(height=340, usermeta={"embedOptions": {"renderer": "svg"}})
    return gr.Plot(plot, visible=not frame.empty), chart.note if not frame.empty else f"No decision chart: {chart.note}"


def generation_columns(summary: JobSummary) -> str:
    """fp32 eager first, then one column per recipe; a failed recipe shows its error in its own column."""
    if summary.reference is None:
        return '<div class="lb-engine">Lower only: no sample generations were asked for.</div>'
    columns = [("fp32 reference", summary.reference, None, None)]
    for report in summary.recipes:
        generated = [g for g in report.generations if g != summary.reference]
        error = report.errors[0].message if report.errors else None
        columns.append((report.recipe.name, generated[0] if generated else None, error, report.runner_note))
    cells = []
    for title, generation, error, runner_note in columns:
        body = []
        if generation:
            runner_stats = (f' · load {generation.model_load_ms} ms · first token '
                            f'{generation.time_to_first_token_ms} ms' if isinstance(generation, RunnerGeneration)
                            else "")
            body.append(f'<div class="lb-engine">{html.escape(generation.engine)} · '
                        f'{generation.decode_tokens_per_s} tok/s decode · '
                        f'{generation.prefill_tokens_per_s} tok/s prefill{runner_stats}</div>')
            body.append(f'<div class="lb-text">{html.escape(generation.text)}</div>')
        if runner_note:  # the step loop's generation is shown instead, labelled with its engine
            body.append(f'<div class="lb-engine">{html.escape(runner_note)}</div>')
        if error:
            body.append(f'<div class="lb-error">error: {html.escape(error)}</div>')
        cells.append(f'<div class="lb-col"><h4>{html.escape(title)}</h4>{"".join(body)}</div>')
    return f'<div class="lb-cols">{"".join(cells)}</div>'


def download_files(summary: JobSummary, job: Path) -> list[str]:
    """One zip per finished recipe, in the job's folder: everything its folder holds, with its model card."""
    return [str(zip_recipe_folder(Path(report.pte.path).parent, job / f"{report.recipe.name}.zip"))
            for report in summary.recipes if report.pte]


CSS = """
.lb-cols {display: flex; gap: 12px; overflow-x: auto}
.lb-col {flex: 1 1 0; min-width: 200px; border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 8px}
.lb-engine {font-size: 0.85em; opacity: 0.8; margin-bottom: 6px}
.lb-text {white-space: pre-wrap}
.lb-error {color: var(--error-text-color, #b91c1c); white-space: pre-wrap}
.lb-backend .info-text {color: var(--body-text-color)}
"""


def shown_error(message: str) -> str:
    """What the status area says after a failed action, so the message outlives its toast."""
    return f'<div class="lb-error" role="alert">Error: {html.escape(message)}</div>'


_LAST_ERRORS: dict[tuple[str, str], str] = {}  # (session, action) -> its last failure's message, until shown


def remember_error(session: str | None, action: str, message: str) -> None:
    if session:
        _LAST_ERRORS[(session, action)] = message


def last_error(session: str | None, action: str) -> str:
    message = _LAST_ERRORS.pop((session, action), None)
    return shown_error(message or "the action failed; the server log has the details.")


def recipe_picker(grouped: dict[str, list]) -> list:
    """One tick list per backend, each with the line saying where its .pte runs; every ticked recipe runs."""
    import gradio as gr

    return [
        gr.CheckboxGroup([(recipe_label(r), r.name) for r in recipes],
                         value=[r.name for r in recipes if r.default],
                         label=recipes[0].backend.title, info=where_it_runs(recipes[0].backend),
                         elem_id=f"recipes-{backend}",
                         elem_classes=["lb-backend"])
        for backend, recipes in grouped.items()
    ]


def option_fields(option_defaults: dict) -> list:
    import gradio as gr

    fields = []
    for (backend, key), default in option_defaults.items():
        label = f"{backend}: {key}"
        if isinstance(default, bool):
            fields.append(gr.Checkbox(default, label=label))
        elif isinstance(default, (int, float)):
            fields.append(gr.Number(default, label=label, precision=0 if isinstance(default, int) else None))
        else:
            fields.append(gr.Textbox(str(default), label=label))
    return fields


def quant_algorithm_choices() -> list[tuple[str, str]]:
    """The quantization algorithm dropdown's (label, value) pairs: each scheme's default, then every algorithm
    of quant/algorithms.py with its one-line description."""
    # loads torch, which main() lets load only after the thread policy is set
    from quant.algorithms import ALGORITHMS
    from quant.schemes import SCHEMES, scheme_options

    defaults = ", ".join(f"{name}: {scheme_options(name)['quant_algorithm']}" for name in SCHEMES
                         if "quant_algorithm" in scheme_options(name))
    # "" leaves each recipe its scheme's own default, as the CLI does without --quant-algorithm
    return [(f"each scheme's default ({defaults})", ""),
            *((f"{name} — {algorithm.description}", name) for name, algorithm in ALGORITHMS.items())]


def quant_controls() -> tuple:
    """The Advanced tab's quantization algorithm and mixed-precision budget (recipe options, as the CLI's
    --quant-algorithm and --mixed-precision-budget) and the per-layer error map (--layer-map)."""
    import gradio as gr

    # loads torch, which main() lets load only after the thread policy is set
    from quant.schemes import SCHEMES, scheme_options

    def schemes_taking(option: str) -> list[str]:
        return [name for name in SCHEMES if option in scheme_options(name)]

    with_algorithm, with_budget = schemes_taking("quant_algorithm"), schemes_taking("mixed_precision_budget")
    algorithm = gr.Dropdown(quant_algorithm_choices(), value="", label="Quantization algorithm",
                            elem_id="quant-algorithm",
                            info=f"how int4 weights get their scales ({', '.join(with_algorithm)} recipes; "
                                 "the others ignore it)")
    budget = gr.Number(0, label="Mixed precision byte budget (0 = off)", elem_id="mixed-precision-budget",
                       info="extra weight bytes per token as a fraction: 0.1 (+10 % bytes per token) keeps at 8 "
                            f"bits the linears that bring the logits closest to fp32 per byte ({', '.join(with_budget)} "
                            "recipes)")
    layer_map = gr.Checkbox(False, label="Per-layer error map: each decoder layer's SQNR against fp32 (costs a "
                                         "second export and lowering per recipe)", elem_id="layer-map")
    return algorithm, budget, layer_map


def calibration_upload():
    """The Advanced tab's calibration file (the CLI's --calibration-file): the job reads and checks it."""
    import gradio as gr

    return gr.File(label="Calibration text (optional): UTF-8 .txt, or .jsonl with a chat a line "
                         "({\"messages\": [{\"role\", \"content\"}, ...]})", file_types=[".txt", ".jsonl"],
                   type="filepath", elem_id="calibration-file")


def kv_cache_controls() -> tuple:
    """The Advanced tab's KV cache dtype and ring window (recipe options of the XNNPACK recipes, as the CLI's
    --kv-cache and --kv-cache-window)."""
    import gradio as gr

    # "" and 0 leave each recipe its own: caches as the model computes, no ring
    dtype = gr.Dropdown([("each recipe's own (as the model computes)", ""), ("fp32", "fp32"), ("fp16", "fp16"),
                         ("int8 — per token and head, ExecuTorch's quantized SDPA", "int8")],
                        value="", label="KV cache", elem_id="kv-cache",
                        info="how the K/V caches are stored (XNNPACK recipes; the others ignore it)")
    window = gr.Number(0, label="KV cache window (0 = off)", precision=0, minimum=0, elem_id="kv-cache-window",
                       info="keep the first 4 tokens and a ring of this many recent ones, so a chat goes on past "
                            "the max context in ExecuTorch's LLM runner (XNNPACK recipes)")
    return dtype, window


def layer_map_line(report: Report) -> str:
    """Which engine made a recipe's per-layer map, or why it has none."""
    name, fidelity = report.recipe.name, report.fidelity
    found = fidelity.layers if fidelity else None
    if found and found.error:
        return f"- **{name}**: no map: {found.error.message}"
    if found:
        return f"- **{name}**: {found.engine}, {found.method} ({len(found.layers)} layers)"
    why = (report.generation_note or (fidelity.error.message if fidelity and fidelity.error else None)
           or "no fidelity was measured")
    return f"- **{name}**: no map: {why}"


def layer_map_panel(recipe_dirs_state, asked, finished_event) -> None:
    """SQNR per decoder layer, one line per recipe, from each recipe's report.json once the job is done;
    shown when the map was asked for, with the engine that made each line."""
    import gradio as gr
    import pandas as pd

    # loads torch, which main() lets load only after the thread policy is set
    from recipes.evaluation.layer_map import sqnr_chart_rows

    with gr.Column(visible=False) as panel:
        gr.Markdown("### Error per decoder layer against fp32")
        chart = gr.LinePlot(x="layer", y="sqnr_db", color="recipe", label="SQNR per layer (dB)",
                            x_title="decoder layer", y_title="SQNR (dB)", elem_id="sqnr-chart")
        engines = gr.Markdown(elem_id="layer-map-engines")

    def show(recipe_dirs, asked_for):
        reports = read_reports(recipe_dirs)
        maps = [r.fidelity.layers for r in reports if r.fidelity and r.fidelity.layers]
        by = sorted({m.engine for m in maps if m.error is None})
        frame = pd.DataFrame(sqnr_chart_rows(reports), columns=["recipe", "layer", "sqnr_db"])
        order = [str(i) for i in sorted(set(frame["layer"]))]
        frame["layer"] = frame["layer"].astype(str)  # one tick per layer, in layer order
        label = "SQNR per layer (dB)" + (f" · {', '.join(by)}" if by else "")
        return (gr.Column(visible=bool(asked_for) or any(maps)), gr.LinePlot(frame, label=label, sort=order),
                "\n".join(layer_map_line(r) for r in reports))

    finished_event.then(show, [recipe_dirs_state, asked], [panel, chart, engines], api_visibility="private")


def profile_panel(recipe_dirs_state, finished_event) -> None:
    """The profile section of the app's page, filled when `finished_event` (the job's event) is done, from the
    report.json of each recipe folder in `recipe_dirs_state` (recipe -> folder)."""
    import gradio as gr

    gr.Markdown("### Where a decode step's time goes (ExecuTorch runtime, ETDump)")
    summary = gr.Markdown()
    chart = gr.BarPlot(x="op", y="ms_per_step", color="kind", sort="-y", x_label_angle=-30,
                       label="A decode step's top ops (ms per step)")
    choice = gr.Dropdown(["all"], value="all", label="Profile table: backend or recipe")
    table = gr.DataFrame(label="Per-op profile (decode step and prefill)")
    rows_state = gr.State([])

    def show(recipe_dirs):
        reports = read_reports(recipe_dirs)
        rows = profile_rows(reports)
        choices = ["all", *dict.fromkeys(r.recipe.backend for r in reports), *(r.recipe.name for r in reports)]
        return (profile_summary(reports), decode_bars(rows), gr.Dropdown(choices=choices, value="all"),
                profile_table(rows, "all"), rows)

    finished_event.then(show, recipe_dirs_state, [summary, chart, choice, table, rows_state],
                        api_visibility="private")
    choice.change(profile_table, [rows_state, choice], table, queue=False, api_visibility="private")


def zoo_tab(source, hub_repo, recipe_lists: list, backend_names: list[str], max_seq_len, group_size):
    """The Zoo tab: the matrix's measured table with a backend filter; choosing a model fills the model
    fields, preselects its recommended recipes and shows their measured figures (data: zoo/entries.py)."""
    import gradio as gr
    import pandas as pd

    entries, cells = zoo.load_entries(), zoo.read_results()

    def table(backend):
        return pd.DataFrame(zoo.table_rows(cells, backend), columns=list(zoo.TABLE_COLUMNS))

    def choose(repo_id):
        if not repo_id:
            return [gr.update()] * (6 + len(backend_names))
        entry = entries[repo_id]
        pick = zoo.selection_for(entry)
        return (
            gr.update(value=BUILTIN if pick["builtin"] else HUB), gr.update(value=pick["repo_id"]),
            *[gr.update(value=[pick["recipes"][name]] if name in pick["recipes"] else []) for name in backend_names],
            gr.update(value=pick["max_seq_len"]), gr.update(value=pick["group_size"] or 32),
            pick["note"], pd.DataFrame(zoo.recommended_for(entry, cells)),
        )

    with gr.Tab("Zoo"):
        gr.Markdown("Measured by `python -m zoo matrix` (zoo/README.md). Choose a model to fill the Lower "
                    "tab's form with its recommended recipes.")
        with gr.Row():
            model = gr.Dropdown(list(entries), value=None, label="Zoo model", elem_id="zoo-model")
            backend = gr.Dropdown(["all", *backend_names], value="all", label="Backend", elem_id="zoo-backend")
        note = gr.Markdown()
        recommended = gr.DataFrame(label="Recommended recipes and what the matrix measured", elem_id="zoo-recommended")
        results = gr.DataFrame(table("all"), label="Zoo matrix (models × recipes)", elem_id="zoo-table")
        backend.change(table, backend, results, queue=False, api_visibility="private")
        model.change(choose, model, [source, hub_repo, *recipe_lists, max_seq_len, group_size, note, recommended],
                     queue=False, api_visibility="private")


def hub_repo_box():
    """The Hub repo id box: typed text is taken as is, and matching repos of the supported families are suggested."""
    import gradio as gr

    return gr.Dropdown([], value=None, allow_custom_value=True, filterable=True, label="Hub repo id",
                       info="type to search the Hub's supported models, e.g. HuggingFaceTB/SmolLM2-135M-Instruct",
                       elem_id="hub-repo")


def hub_suggestion_note(text: str, token: str | None) -> tuple[list[tuple[str, str]], str]:
    """(the box's suggestions as (label, repo id), the line under it) for what was typed so far."""
    if len((text or "").strip()) < MIN_CHARACTERS:
        return [], ""
    try:
        found = suggest_repos(text, (token or "").strip() or None)
    except UserFacingError as err:
        return [], str(err)
    if not found:
        return [], f"No repo of a supported family on the Hub contains {text.strip()!r}; a typed repo id is used as is."
    return [(s.label, s.repo_id) for s in found], ""


def hub_suggestions(hub_repo, token, note) -> None:
    """As a person types in the repo box, its list shows the matching repos and `note` says why when none."""
    import gradio as gr

    def suggest(token_text, typed: gr.KeyUpData):
        choices, line = hub_suggestion_note(typed.input_value, token_text)
        return gr.Dropdown(choices=choices), line

    hub_repo.key_up(suggest, token, [hub_repo, note], queue=False, show_progress="hidden",
                    api_visibility="private")


@dataclass(frozen=True)
class ModelFields:
    """The form's model fields, as typed: where the checkpoint comes from (choose_model), its revision, the token."""
    source: str
    hub_repo: str = ""
    revision: str = ""
    local_path: str = ""
    token: str = ""


def job_cost_text(model_fields: ModelFields, recipe_names: list[str], options: dict, max_seq_len: int,
                  export_only: bool) -> str:
    """What the job on the form would cost (memory, disk, time) and whether it would be refused, in Markdown."""
    from huggingface_hub import constants

    # loads torch, which main() lets load only after the thread policy is set
    from models.sources.model_config import hub_weights_cached, model_config
    from recipes.estimates.job_cost import job_cost
    from recipes.registry import get_recipe
    from recipes.request import check_recipe_options, recipe_options

    if not recipe_names:
        return "Tick at least one recipe to see what the job will cost."
    try:
        model = choose_model(model_fields.source, model_fields.hub_repo, model_fields.local_path)
        revision = (model_fields.revision or "").strip() or None
        config = model_config(model, revision, (model_fields.token or "").strip() or None)
        recipes = [get_recipe(name) for name in recipe_names]
        per_recipe = {recipe.name: recipe_options(recipe, options) for recipe in recipes}
        for recipe in recipes:
            check_recipe_options(recipe, per_recipe[recipe.name])
        downloads = model_fields.source == HUB and not hub_weights_cached(model, revision)
        cost = job_cost(config, recipes, per_recipe, int(max_seq_len), not export_only, jobs_root(),
                        Path(constants.HF_HUB_CACHE) if downloads else None)
    except UserFacingError as err:
        return f"**No estimate yet**: {err}"
    return cost_markdown(cost, export_only)


def cost_markdown(cost, export_only: bool) -> str:
    """The estimate's lines: a refusal first, then memory, disk and time (why not, without a time estimate)."""
    # loads torch, which main() lets load only after the thread policy is set
    from recipes.estimates.time_estimate import duration_label, size_label

    gb = 1e9
    estimate = cost.estimate
    kind = "export-only job" if export_only else "full job"
    recipes = len(estimate.recipes)
    lines = [f"**Estimate before you press Lower**: {size_label(cost.parameters)} parameters, {recipes} "
             f"recipe{'s' if recipes > 1 else ''}, {kind}."]
    if cost.refusal:
        lines.append(f"**This job would be refused**: {cost.refusal}")
    fits = "fits in" if cost.refusal is None else "more than"
    lines.append(f"- Memory: about {estimate.peak_rss_bytes / gb:.1f} GB at its peak ({estimate.peak_stage}); "
                 f"{fits} {cost.budget_where}.")
    disk = f"{bytes_label(estimate.disk_bytes)} of .pte files ({cost.output_free_bytes / gb:.0f} GB free)"
    if cost.download_bytes:
        disk = (f"{bytes_label(cost.download_bytes)} to download into the Hugging Face cache "
                f"({cost.download_free_bytes / gb:.0f} GB free), then " + disk)
    short = (cost.download_bytes > (cost.download_free_bytes or 0) or estimate.disk_bytes > cost.output_free_bytes)
    lines.append(f"- Disk: {disk}" + ("; **not enough free disk**." if short else "."))
    if cost.time_unknown is not None:
        return "\n".join([*lines, f"- Time: no estimate ({cost.time_unknown})."])
    times = [row.time for row in estimate.recipes]
    parts = {part: sum(getattr(time, part) for time in times) for part in ("export", "lower", "other")}
    rest = "quantizing" if export_only else "quantizing, generating and scoring"
    shared = "loading" if export_only else "loading and the fp32 reference"
    fit = times[0]  # the shared stages and the cells behind the rates are the job's, the same for every recipe
    lines.append(f"- Time: about {duration_label(estimate.seconds)} ({shared} {duration_label(fit.shared)}, "
                 f"export {duration_label(parts['export'])}, lowering {duration_label(parts['lower'])}, {rest} "
                 f"{duration_label(parts['other'])}); rates fitted on zoo cells of {fit.fitted_on} measured on "
                 f"{fit.rates_from}, scaled to this host's speed ({fit.host_speed:.2f}× theirs).")
    lines += [f"  - {note}." for note in estimate.time_notes]
    return "\n".join(lines)


def bytes_label(count: int) -> str:
    """2.5 GB, 136 MB, 0.31 MB."""
    if count >= 1e9:
        return f"{count / 1e9:.1f} GB"
    return f"{count / 1e6:.0f} MB" if count >= 1e6 else f"{count / 1e6:.2f} MB"


def cost_panel(ticked, choice_inputs: list, model_inputs: list, max_seq_len, group_size, export_only):
    """The job's estimate, shown when the page loads and again whenever the model, the ticked recipes or the
    settings change. `ticked` turns the choice inputs (recipe lists, backend options, algorithm, budget, KV cache) into
    (recipe names, options) as the Lower button does; model_inputs are the fields of ModelFields, in its order."""
    import gradio as gr

    # loads torch, which main() lets load only after the thread policy is set
    from recipes.request import user_options

    def cost(source_, hub_repo_, revision_, local_path_, token_, max_seq_len_, group_size_, export_only_, *choices):
        names, options = ticked(*choices)
        return job_cost_text(ModelFields(source_, hub_repo_, revision_, local_path_, token_), names,
                             {**options, **user_options(group_size_)}, max_seq_len_ or 16, bool(export_only_))

    return gr.Markdown(cost, inputs=[*model_inputs, max_seq_len, group_size, export_only, *choice_inputs],
                       elem_id="job-cost")


def build_app():
    import gradio as gr

    with gr.Blocks(title="Lowerbench") as demo:
        gr.Markdown("# Lowerbench\nLower a Llama checkpoint to ExecuTorch with one or more backend recipes and "
                    "compare them side by side. The same runs from a script: `python -m recipes run --recipe A "
                    "--recipe B --out DIR`.")
        with gr.Tab("Lower"):
            form = lower_page()
        zoo_tab(**form)
    return demo


def lower_page() -> dict:
    """The model, the recipes and the run settings; then the job's status and its results. Returns the form
    fields another tab fills (the Zoo's choice of model)."""
    import gradio as gr
    import pandas as pd

    # loads torch, which main() lets load only after the thread policy is set
    from recipes.running.generate import DEFAULT_PROMPT
    from recipes.request import RunRequest, user_options

    grouped = backends()
    all_recipes = [r.name for recipes in grouped.values() for r in recipes]
    option_defaults = backend_option_defaults(grouped)

    def ticked(*values):
        """The ticks at the moment Lower is pressed: the recipes (every list), the backend options, then the
        quantization algorithm and budget, then the KV cache dtype and window."""
        lists, options = values[: len(grouped)], values[len(grouped): len(grouped) + len(option_defaults)]
        return ([name for names in lists for name in names or []],
                {**{key: value for (_, key), value in zip(option_defaults, options)},
                 **user_options(None, *values[len(grouped) + len(option_defaults):])})

    def lower(source, hub_repo, revision, local_path, token, recipes, prompt, max_new_tokens, max_seq_len,
              group_size, options, export_only=False, layer_map=False, weights_file=False, calibration_file=None,
              adapter="", adapter_revision="", oauth_token: gr.OAuthToken | None = None,
              request: gr.Request = None, progress=gr.Progress()):
        session = request.session_hash if request is not None else None
        try:
            model = choose_model(source, hub_repo, local_path)
            adapter = choose_adapter(adapter)
            with job_folder() as job:  # a failed or cancelled job leaves nothing behind
                run_request = RunRequest(
                    recipes=list(recipes or []), out_dir=job, model=model,
                    revision=(revision or "").strip() or None,
                    token=(oauth_token.token if oauth_token else None) or (token or "").strip() or None,
                    prompt=prompt or "", max_new_tokens=int(max_new_tokens), max_seq_len=int(max_seq_len),
                    options={**(options or {}), **user_options(group_size)},
                    generate=not export_only, layer_map=bool(layer_map),
                    weights_file=True if weights_file else None,  # unticked: the size decides
                    calibration_file=Path(calibration_file) if calibration_file else None,
                    adapter=adapter, adapter_revision=(adapter_revision or "").strip() or None,
                )
                summary = run_job(run_request, session or job.name, lambda f, m: progress(f, desc=m))
        except UserFacingError as err:
            remember_error(session, "lower", str(err))
            raise gr.Error(str(err), print_exception=False) from None
        ops = op_rows(summary)
        reports = summary.recipes
        finished = [r.recipe.name for r in reports if r.pte]
        failed = [r for r in reports if r.errors]
        status = f"Job `{job.name}`: {len(reports) - len(failed)} of {len(reports)} recipes finished."
        dirs = {r.recipe.name: str(Path(r.pte.path).parent) for r in reports if r.pte}
        return (
            status, pd.DataFrame(summary_rows(summary)), delegation_frame(summary),
            filter_ops(ops, "all"),
            gr.Dropdown(choices=["all", *dict.fromkeys(r.recipe.backend for r in reports),
                                 *(r.recipe.name for r in reports)], value="all"),
            generation_columns(summary), download_files(summary, job),
            gr.Dropdown(choices=finished, value=finished[0] if finished else None), ops, dirs,
            gr.Column(visible=True), *decision_plot(summary),
        )

    def cancel(request: gr.Request):
        if cancel_job(request.session_hash):
            return "Cancelling after the current stage…"
        return "No job of yours is running."

    def push(recipe, repo_name, private, token, dirs, oauth_token: gr.OAuthToken | None = None,
             request: gr.Request = None):
        session = request.session_hash if request is not None else None
        try:
            if not recipe or recipe not in (dirs or {}):
                raise UserFacingError("run a recipe first, then choose which one to push.")
            url = push_to_hub(dirs[recipe], repo_name or "", (oauth_token.token if oauth_token else None)
                              or (token or "").strip() or None, private=bool(private))
        except UserFacingError as err:
            remember_error(session, "push", str(err))
            raise gr.Error(str(err), print_exception=False) from None
        return f"Pushed {recipe}: {url}"

    def lower_failed(request: gr.Request):
        return last_error(request.session_hash, "lower"), gr.Column(visible=False)

    def push_failed(request: gr.Request):
        return last_error(request.session_hash, "push")

    with gr.Row():
        with gr.Column(scale=1):
            source = gr.Radio([BUILTIN, HUB, LOCAL], value=BUILTIN, label="Model")
            with gr.Row():
                hub_repo = hub_repo_box()
                revision = gr.Textbox(label="Revision", placeholder="main")
            hub_note = gr.Markdown(elem_id="hub-note")
            local_path = gr.Textbox(label="Local path (Hugging Face folder or .gguf)")
            if ON_SPACE:
                gr.LoginButton()
            token = gr.Textbox(label="Hub token (for gated models and pushing; never stored)", type="password")
            hub_suggestions(hub_repo, token, hub_note)
        with gr.Column(scale=1):
            gr.Markdown("**Recipes** (every ticked recipe runs)")
            recipe_lists = recipe_picker(grouped)
            with gr.Accordion("Advanced", open=False):
                max_seq_len = gr.Number(512, label="Max context (tokens)", precision=0, minimum=16)
                group_size = gr.Number(32, label="Weight group size", precision=0, minimum=0)
                export_only = gr.Checkbox(False, label="Lower only: write the .pte and its delegation report, "
                                                       "no sample generations or fidelity")
                weights_file = gr.Checkbox(False, label="Weights in model.ptd beside model.pte (where the backend can; "
                                                        "unticked: above 2 GiB of program)")
                option_inputs = option_fields(option_defaults)
                algorithm, budget, layer_map = quant_controls()
                calibration_file = calibration_upload()
                kv_cache, kv_window = kv_cache_controls()
                with gr.Row():
                    # An initial value makes the /lower endpoint's parameters optional for API clients.
                    adapter = gr.Textbox("", label="LoRA adapter (local folder or Hub repo id; merged before "
                                                   "quantization)", placeholder="none")
                    adapter_revision = gr.Textbox("", label="Adapter revision", placeholder="main")
            choices = [*recipe_lists, *option_inputs, algorithm, budget, kv_cache, kv_window]
            # The /lower endpoint takes one recipe list and one options dict; pressing Lower fills them from the ticks.
            picked, picked_options = ticked(*[c.value for c in choices])
            recipes_box = gr.Dropdown(all_recipes, value=picked, multiselect=True, label="Recipes", visible=False)
            options_box = gr.JSON(picked_options, visible=False)
            prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt")
            max_new_tokens = gr.Slider(1, 256, 32, step=1, label="Max new tokens")
            cost_panel(ticked, choices, [source, hub_repo, revision, local_path, token], max_seq_len, group_size,
                       export_only)
            with gr.Row():
                lower_btn = gr.Button("Lower", variant="primary")
                cancel_btn = gr.Button("Cancel", variant="stop")
    status = gr.Markdown(elem_id="status")

    with gr.Column(visible=False) as results:
        summary_table = gr.DataFrame(label="Summary (one row per recipe)", elem_id="summary-table")
        gr.Markdown("### Which recipe: speed against fidelity")
        decision = gr.Plot(label="Decision chart", elem_id="decision-chart")
        decision_note = gr.Markdown(elem_id="decision-note")
        chart = gr.BarPlot(x="recipe", y="nodes", color="kind", label="Delegated vs non-delegated nodes")
        op_filter = gr.Dropdown(["all"], value="all", label="Per-op table: backend or recipe")
        op_table = gr.DataFrame(label="Per-op delegation")
        gr.Markdown("### Sample generations")
        generations = gr.HTML(elem_id="generations")
        files = gr.File(label="Downloads (one zip per recipe: its folder and model card)", file_count="multiple",
                        elem_id="downloads")
        with gr.Accordion("Push to Hub", open=False):
            push_recipe = gr.Dropdown([], label="Recipe")
            repo_name = gr.Textbox(label="Repo (name, or owner/name; created if missing)")
            private = gr.Checkbox(False, label="Private")
            push_btn = gr.Button("Push to Hub")
            push_status = gr.Markdown(elem_id="push-status")
    ops_state, dirs_state = gr.State([]), gr.State({})

    finished = lower_btn.click(
        ticked, choices, [recipes_box, options_box], queue=False,
        api_visibility="private",
    ).success(
        lower,
        [source, hub_repo, revision, local_path, token, recipes_box, prompt, max_new_tokens, max_seq_len,
         group_size, options_box, export_only, layer_map, weights_file, calibration_file, adapter, adapter_revision],
        [status, summary_table, chart, op_table, op_filter, generations, files, push_recipe, ops_state, dirs_state,
         results, decision, decision_note],
        api_name="lower", show_progress_on=[status],
    )
    finished.failure(lower_failed, None, [status, results], queue=False, api_visibility="private")
    cancel_btn.click(cancel, None, status, concurrency_limit=None, api_name="cancel")
    op_filter.change(filter_ops, [ops_state, op_filter], op_table, queue=False, api_visibility="private")
    push_btn.click(push, [push_recipe, repo_name, private, token, dirs_state], push_status, api_name="push",
                   show_progress_on=[push_status],
                   ).failure(push_failed, None, push_status, queue=False, api_visibility="private")
    with results:
        layer_map_panel(dirs_state, layer_map, finished)
        profile_panel(dirs_state, finished)
    return {"source": source, "hub_repo": hub_repo, "recipe_lists": recipe_lists, "backend_names": list(grouped),
            "max_seq_len": max_seq_len, "group_size": group_size}


def main(argv: list[str] | None = None) -> None:
    thread_policy.limit_openmp_default()  # before anything loads torch; the job processes inherit it
    silence_dependency_noise()  # before torchao is imported: it logs at import
    parser = argparse.ArgumentParser(description="Lowerbench web app")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    args = parser.parse_args(argv)
    root = jobs_root()
    root.mkdir(parents=True, exist_ok=True)
    demo = build_app()
    demo.queue(default_concurrency_limit=int(os.environ.get("LOWERBENCH_CONCURRENCY", "2")))
    demo.launch(server_name=args.host, server_port=args.port, allowed_paths=[str(root)], css=CSS,
                show_error=True, max_file_size=MAX_CALIBRATION_FILE_BYTES)  # the only upload


if __name__ == "__main__":
    sys.exit(main())
