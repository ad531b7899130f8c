"""A report's profile (recipes/running/profile.py) as people read it: a decode step's top ops as bar-chart rows,
delegated vs not, the per-op table with a backend or recipe filter, and the model card's section. Plain data,
the same for a script; app.py puts it on the page."""
from __future__ import annotations

from recipes.output.report import Report, load_report

TABLE_COLUMNS = ["backend", "recipe", "phase", "op", "delegated", "delegate", "count", "ms_per_step",
                 "p50_ms_per_step", "percent_of_step"]
BAR_COLUMNS = ["op", "ms_per_step", "kind", "recipe"]
OTHER_OPS = "other ops"


def profile_rows(reports: list[Report]) -> list[dict]:
    """One row per op of each profiled recipe, decode step first, then the prefill."""
    rows = []
    for report in reports:
        profile = report.profile
        for phase, measured in (("decode", profile and profile.decode), ("prefill", profile and profile.prefill)):
            for op in measured.ops if measured else []:
                rows.append({"backend": report.recipe.backend, "recipe": report.recipe.name,
                             "phase": phase, "op": op.op, "delegated": op.delegated, "delegate": op.backend,
                             "count": op.count, "ms_per_step": op.ms_per_step,
                             "p50_ms_per_step": op.p50_ms_per_step, "percent_of_step": op.percent_of_step})
    return rows


def decode_bars(rows: list[dict], top: int = 10):
    """Per recipe, a decode step's `top` costliest ops and the rest summed as "other ops"; the bar's label names
    the recipe when there are several."""
    import pandas as pd

    decode = [r for r in rows if r["phase"] == "decode"]
    recipes = list(dict.fromkeys(r["recipe"] for r in decode))
    bars = []
    for recipe in recipes:
        ops = sorted((r for r in decode if r["recipe"] == recipe), key=lambda r: r["ms_per_step"], reverse=True)
        label = (lambda op: f"{recipe}: {op}") if len(recipes) > 1 else (lambda op: op)
        for row in ops[:top]:
            bars.append({"op": label(row["op"]), "ms_per_step": row["ms_per_step"],
                         "kind": "delegated" if row["delegated"] else "not delegated", "recipe": recipe})
        rest = ops[top:]
        if rest:
            bars.append({"op": label(OTHER_OPS), "ms_per_step": round(sum(r["ms_per_step"] for r in rest), 4),
                         "kind": "mixed", "recipe": recipe})
    return pd.DataFrame(bars, columns=BAR_COLUMNS)


def profile_table(rows: list[dict], choice: str | None):
    """The per-op table for one backend, one recipe, or all of them."""
    import pandas as pd

    kept = [r for r in rows or [] if choice in (None, "", "all", r["backend"], r["recipe"])]
    return pd.DataFrame(kept, columns=TABLE_COLUMNS)


def profile_summary(reports: list[Report]) -> str:
    """One line per recipe: its decode step and the share outside delegates, or why it has no profile."""
    lines = []
    for report in reports:
        name, profile = report.recipe.name, report.profile
        if profile and profile.decode:
            decode = profile.decode
            lines.append(f"- **{name}** ({profile.engine}, executorch {profile.executorch}): decode step "
                         f"{decode.step_ms} ms, {decode.outside_delegates_percent} % outside delegates; "
                         f"load {profile.load.load_method_ms} ms")
        else:
            lines.append(f"- **{name}**: no profile ({report.profile_note or 'not profiled'})")
    return "\n".join(lines)


def read_reports(recipe_dirs: dict) -> list[Report]:
    """The report of each recipe folder in `recipe_dirs` (recipe -> folder)."""
    return [load_report(folder) for folder in (recipe_dirs or {}).values()]


def model_card_lines(report: Report, top: int = 5) -> list[str]:
    """The model card's profile section: a decode step's top ops, and how to open the ETDump and ETRecord."""
    profile = report.profile
    if not profile or not profile.decode:
        return []
    decode = profile.decode
    lines = ["## Where a decode step's time goes", "",
             f"Measured by Lowerbench on the ExecuTorch runtime (executorch {profile.executorch}, event tracer on): "
             f"{decode.step_ms} ms per decode step, {decode.outside_delegates_percent} % of it outside "
             "delegates.", "", "| op | delegated | count | ms per step | % of step |", "|---|---|---|---|---|"]
    for op in decode.ops[:top]:
        lines.append(f"| {op.op} | {op.backend or 'no'} | {op.count} | {op.ms_per_step} | {op.percent_of_step} |")
    lines += ["", "Lowerbench writes `model.etdump` (decode steps), `prefill.etdump` and `etrecord.bin` beside "
              "`model.pte`; open them with `executorch.devtools.Inspector(etdump_path=\"model.etdump\", "
              "etrecord=\"etrecord.bin\")`.", ""]
    return lines
