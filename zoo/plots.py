"""The zoo's figures written as PNGs; zoo/scaling.png: what an export-only job costs against the model's parameter
count, one line per recipe, from the matrix's finished export-only cells (of a model measured twice, the cell the
zoo shows)."""
from __future__ import annotations

from pathlib import Path

from recipes.files.atomic_write import write_atomically
from zoo.cell_result import CellResult
from zoo.entries import preferred_cell

# A line needs this many models to say anything about how the cost grows.
MIN_MODELS = 3


def scaling_series(cells: list[CellResult], parameters_of) -> dict[str, list[dict]]:
    """recipe -> [{model, params, peak_gib, pte_gb}] sorted by params, for recipes finished export-only on at
    least MIN_MODELS models. A cell records its model's parameter count; for one that does not,
    `parameters_of(model repo id)` gives it, or None (that model is left out)."""
    finished = [c for c in cells if c.status == "ok" and c.export_only and c.measured.peak_rss_mb]
    recorded = {c.model: c.params for c in finished if c.params}
    sizes = {m: recorded.get(m) or parameters_of(m) for m in dict.fromkeys(c.model for c in finished)}
    finished = [c for c in finished if sizes[c.model]]
    series: dict[str, list[dict]] = {}
    for recipe in sorted({c.recipe for c in finished}):
        points = []
        for model in dict.fromkeys(c.model for c in finished if c.recipe == recipe):
            cell = preferred_cell([c for c in finished if (c.model, c.recipe) == (model, recipe)])
            points.append({"model": model, "params": sizes[model], "peak_gib": cell.measured.peak_rss_mb / 1024,
                           "pte_gb": (cell.measured.pte_mb or 0) / 1000, "executorch": cell.executorch_version})
        if len(points) >= MIN_MODELS:
            series[recipe] = sorted(points, key=lambda p: p["params"])
    return series


def write_scaling_plot(series: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    newest = max((p["executorch"] for points in series.values() for p in points), default=())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for recipe, points in series.items():
        x = [p["params"] / 1e9 for p in points]
        for ax, key in zip(axes, ("peak_gib", "pte_gb")):
            line, = ax.plot(x, [p[key] for p in points], label=recipe)
            for point, at in zip(points, x):  # hollow: measured on an older executorch than the newest here
                ax.plot(at, point[key], "o", color=line.get_color(),
                        markerfacecolor=line.get_color() if point["executorch"] == newest else "white")
    for ax, label in zip(axes, ("peak RSS, export-only (GiB)", ".pte size (GB)")):
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    version = ".".join(map(str, newest))
    fig.suptitle(f"Lowerbench zoo: export-only cost against model size (filled: executorch {version}; "
                 "hollow: an earlier one)", fontsize=10)
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """The figure as a PNG, written atomically, and closed."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_atomically(path, png.getvalue())
