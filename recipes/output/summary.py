"""A job's recipes side by side, as a person reads them: one row of figures per recipe with human labels and
units (the app's summary table, summary.json and the CLI's table), and the decision chart's points.

Every figure is read once from the typed report (`recipe_figures`); a figure a recipe has not got reads "–",
never a raw None, NaN or a section of the report."""
from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.output.report import JobSummary, Report

ENGINE_OF_APPS = "executorch-llm-runner"  # recipes/running/llm_runner.py: ExecuTorch's TextLLMRunner
ENGINES_OF_A_PTE = ("executorch-runtime", ENGINE_OF_APPS)
REFERENCE_ENGINES = ("eager-fp32", "eager-bf16", "eager-fp16")  # the eager reference's (recipes/pipeline/run.py)
MISSING = "–"


@dataclass(frozen=True)
class RecipeFigures:
    """The figures that rank a recipe; None where the job did not measure one."""
    recipe: str
    backend: str
    engine: str | None  # of the generation its decode speed is from: the LLM runner's where it ran, else the first
    delegated_subgraphs: int | None
    delegated_percent: float | None  # of the lowered graph's nodes
    in_delegates_percent: float | None  # of a decode step's time (the profile)
    pte_mb: float | None
    ptd_mb: float | None  # the program's weights file beside it, for a program that keeps them apart
    weights_mb_per_token: float | None
    decode_tokens_per_s: float | None
    perplexity_ratio: float | None
    heldout_ratio: float | None
    top1_percent: float | None
    mean_kl: float | None
    target: str | None  # the scheme's fidelity target, and whether it was met
    meets_target: bool | None
    export_s: float | None
    lower_s: float | None
    total_s: float | None  # the recipe's wall, its share of the job's loading and reference included
    estimated_s: float | None  # as estimated before the job
    peak_gb: float | None
    estimated_peak_gb: float | None
    error: str | None

    @property
    def ran_as_pte(self) -> bool:
        return self.engine in ENGINES_OF_A_PTE


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _rounded(value, digits: int) -> float | None:
    value = _number(value)
    return None if value is None else round(value, digits)


def recipe_figures(report: Report, reference=None) -> RecipeFigures:
    delegation, fidelity = report.delegation, report.fidelity if report.fidelity and not report.fidelity.error else None
    # a report lists the reference's generation first, then the recipe's
    generated = [g for g in report.generations if g != reference and g.engine not in REFERENCE_ENGINES]
    # the runner a device app runs, where it ran: one engine's speed, not whichever generation came first
    generated = [g for g in generated if g.engine == ENGINE_OF_APPS] or generated
    decode = report.profile.decode if report.profile else None
    outside = _number(decode.outside_delegates_percent) if decode else None
    quantization = report.quantization
    per_token = quantization.weight_bytes_per_token if quantization else None
    return RecipeFigures(
        recipe=report.recipe.name, backend=report.recipe.backend,
        engine=generated[0].engine if generated else None,
        delegated_subgraphs=delegation.delegated_subgraphs if delegation else None,
        delegated_percent=_rounded(delegation.delegated_percent, 1) if delegation else None,
        in_delegates_percent=None if outside is None else round(100.0 - outside, 1),
        pte_mb=round(report.pte.bytes / 1e6, 2) if report.pte else None,
        ptd_mb=round(report.pte.ptd_bytes / 1e6, 2) if report.pte and report.pte.ptd_bytes else None,
        weights_mb_per_token=None if _number(per_token) is None else round(per_token / 1e6, 2),
        decode_tokens_per_s=_rounded(generated[0].decode_tokens_per_s, 1) if generated else None,
        perplexity_ratio=_rounded(fidelity.perplexity_ratio, 3) if fidelity else None,
        heldout_ratio=_rounded(fidelity.heldout.perplexity_ratio, 3) if fidelity and fidelity.heldout else None,
        top1_percent=_rounded(fidelity.top1_agreement_percent, 1) if fidelity else None,
        mean_kl=_rounded(fidelity.mean_kl, 4) if fidelity else None,
        target=fidelity.target if fidelity else None,
        meets_target=fidelity.meets_target if fidelity else None,
        export_s=_rounded(report.timings.export, 1), lower_s=_rounded(report.timings.lower, 1),
        total_s=_rounded(report.timings.total, 1),
        estimated_s=_rounded(report.timings.estimate.total, 1) if report.timings.estimate else None,
        peak_gb=None if _number(report.timings.peak_rss_mb) is None else round(report.timings.peak_rss_mb / 1e3, 2),
        estimated_peak_gb=_estimated_peak_gb(report),
        error=report.errors[0].message if report.errors else None,
    )


def _estimated_peak_gb(report: Report) -> float | None:
    """The peak the memory estimate put on the recipe before the job, its share of the job's shared stages
    (loading, the reference) included as in the measured figure; the job's peak where it has no row."""
    estimate = report.memory.estimate if report.memory else None
    if estimate is None:
        return None
    row = estimate.recipe_row(report.recipe.name)
    peaks = [*estimate.stages.values(), row.peak_rss_bytes] if row else [estimate.peak_rss_bytes]
    peaks = [p for p in peaks if _number(p) is not None]
    return round(max(peaks) / 1e9, 2) if peaks else None


def job_figures(summary: JobSummary) -> list[RecipeFigures]:
    return [recipe_figures(report, summary.reference) for report in summary.recipes]


def _shown(value) -> object:
    return MISSING if value is None else value


def target_cell(figures: RecipeFigures) -> str:
    """The scheme's fidelity target and whether this recipe met it, e.g. "perplexity <= 1.10 x fp32 eager: no"."""
    if figures.target is None or figures.meets_target is None:
        return MISSING
    return f"{figures.target}: {'yes' if figures.meets_target else 'no'}"


# label (with its unit) -> the figure it shows; the app's table, summary.json and the CLI's table use these
COLUMNS = {
    "recipe": lambda f: f.recipe,
    "backend": lambda f: f.backend,
    "engine": lambda f: f.engine,
    "delegated (% of nodes)": lambda f: f.delegated_percent,
    "in delegates (% of decode time)": lambda f: f.in_delegates_percent,
    "delegated subgraphs": lambda f: f.delegated_subgraphs,
    ".pte (MB)": lambda f: f.pte_mb,
    ".ptd (MB)": lambda f: f.ptd_mb,
    "weights read per token (MB)": lambda f: f.weights_mb_per_token,
    "decode (tok/s)": lambda f: f.decode_tokens_per_s,
    "perplexity vs fp32 (×)": lambda f: f.perplexity_ratio,
    "held-out (×)": lambda f: f.heldout_ratio,
    "top-1 agreement (%)": lambda f: f.top1_percent,
    "mean KL": lambda f: f.mean_kl,
    "fidelity target": target_cell,
    "export (s)": lambda f: f.export_s,
    "lower (s)": lambda f: f.lower_s,
    "time (s)": lambda f: f.total_s,
    "estimated time (s)": lambda f: f.estimated_s,
    "peak RSS (GB)": lambda f: f.peak_gb,
    "estimated peak RSS (GB)": lambda f: f.estimated_peak_gb,
    "error": lambda f: f.error,
}


def summary_rows(summary: JobSummary) -> list[dict]:
    """One row per recipe, labelled with units; "–" where a recipe has no such figure."""
    return [{label: _shown(figure(f)) for label, figure in COLUMNS.items()} for f in job_figures(summary)]


def text_table(rows: list[dict]) -> str:
    """The rows as aligned columns for a terminal, one line per recipe."""
    if not rows:
        return ""
    labels = list(rows[0])
    cells = [[str(row[label]) for label in labels] for row in rows]
    widths = [max(len(label), *(len(line[i]) for line in cells)) for i, label in enumerate(labels)]
    lines = ["  ".join(label.ljust(width) for label, width in zip(labels, widths)).rstrip()]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
    return "\n".join(lines)


@dataclass(frozen=True)
class DecisionChart:
    """Speed (or weight bytes read per token) against fidelity, one point per recipe sized by its .pte."""
    x_title: str
    points: list[dict]  # {recipe, x, perplexity_ratio, pte_mb, label}
    note: str  # which engine measured what, or why recipes are missing


def decision_chart(summary: JobSummary) -> DecisionChart:
    """Decode tok/s on the x axis when every recipe's .pte ran here (the same engines, comparable speeds); else
    the weight bytes each decode step reads, which sets speed on a bandwidth-bound device, for every recipe."""
    figures = job_figures(summary)
    measured = [f for f in figures if f.perplexity_ratio is not None]
    by_speed = bool(measured) and all(f.ran_as_pte and f.decode_tokens_per_s is not None for f in measured)
    x_of = (lambda f: f.decode_tokens_per_s) if by_speed else (lambda f: f.weights_mb_per_token)
    points = [{"recipe": f.recipe, "x": x_of(f), "perplexity_ratio": f.perplexity_ratio,
               "pte_mb": f.pte_mb or 0.0, "label": f"{f.recipe} · {f.engine}"}
              for f in measured if x_of(f) is not None]
    left_out = [f.recipe for f in figures if f.recipe not in {p["recipe"] for p in points}]
    notes = ["speed: each .pte on the ExecuTorch runtime" if by_speed else
             "not every .pte runs here, so the x axis is the weight bytes a decode step reads"]
    notes.append("fidelity: each recipe's engine against the fp32 eager reference")
    if left_out:
        notes.append(f"not shown (no fidelity measured or no figure): {', '.join(left_out)}")
    return DecisionChart("decode (tok/s)" if by_speed else "weights read per token (MB)", points, "; ".join(notes))
