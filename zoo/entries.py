"""The zoo: one JSON file per Llama-family Hub model under zoo/models/ (published config, license, gating,
recommended recipe per backend), and the matrix's measured cells in zoo/results.json. Data logic only:
the app's Zoo tab and `python -m zoo matrix` read through here."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from models.errors import UserFacingError
from zoo.cell_result import CellResult, load_results

ZOO_DIR = Path(__file__).resolve().parent
NEEDS_REAL_WEIGHTS = "needs real weights"


def repo_slug(repo_id: str) -> str:
    """An entry's name from its Hub repo id, where no entry file names it."""
    return repo_id.split("/")[-1].lower()


@dataclass(frozen=True)
class ZooEntry:
    repo_id: str
    title: str
    license: str
    gated: bool
    ungated_mirror: str | None
    builtin: bool  # its real weights ship with Lowerbench (the built-in GGUF)
    config: dict  # the published config.json, copied
    recommended: dict  # backend -> {recipe, max_seq_len, options, quant_algorithm, why}
    path: str = ""

    @property
    def slug(self) -> str:
        return Path(self.path).stem if self.path else repo_slug(self.repo_id)

    def model_config(self):
        """The published config as its family's transformers config class (chosen by model_type, as a checkpoint's
        config.json is read)."""
        from transformers import AutoConfig

        fields = {k: v for k, v in self.config.items() if k != "model_type"}
        return AutoConfig.for_model(self.config["model_type"], **fields)


def read_entry(path: Path) -> ZooEntry:
    raw = json.loads(Path(path).read_text())
    return ZooEntry(repo_id=raw["repo_id"], title=raw.get("title", raw["repo_id"]), license=raw["license"],
                    gated=bool(raw["gated"]), ungated_mirror=raw.get("ungated_mirror"),
                    builtin=bool(raw.get("builtin", False)), config=raw["config"],
                    recommended=raw.get("recommended", {}), path=str(path))


def load_entries(zoo_dir: Path = ZOO_DIR) -> dict[str, ZooEntry]:
    """repo id -> entry, in file-name order."""
    return {e.repo_id: e for e in (read_entry(p) for p in sorted((Path(zoo_dir) / "models").glob("*.json")))}


def find_entry(name: str, zoo_dir: Path = ZOO_DIR) -> ZooEntry:
    """A repo id, a file-name stem (`llama-3.2-1b-instruct`) or the path of an entry file."""
    if name.endswith(".json") and Path(name).is_file():
        return read_entry(Path(name))
    entries = load_entries(zoo_dir)
    for entry in entries.values():
        if name in (entry.repo_id, entry.slug) or name.lower() == entry.repo_id.lower():
            return entry
    raise UserFacingError(f"{name!r} is not in the zoo; choose one of: {', '.join(entries)} (or an entry .json file).")


def recommendation_problems(entry: ZooEntry) -> list[str]:
    """Why a recommended recipe does not fit the entry's shape (empty when every one fits)."""
    # these load torch, and the app reads this module in its server process before its thread policy is set
    from quant.schemes import GROUP_SIZES, SCHEMES, linear_input_dims
    from recipes.registry import RECIPES, load_backends

    load_backends()
    config = entry.model_config()
    limit = config.max_position_embeddings
    dims = linear_input_dims(config)
    problems = []
    for backend, rec in entry.recommended.items():
        recipe = RECIPES.get(rec["recipe"])
        if recipe is None:
            problems.append(f"{backend}: recipe {rec['recipe']!r} is not registered")
            continue
        if recipe.backend.name != backend:
            problems.append(f"{backend}: {recipe.name} is a {recipe.backend.name} recipe")
        if not 16 <= rec["max_seq_len"] <= limit:
            problems.append(f"{recipe.name}: max context {rec['max_seq_len']} outside 16..{limit}")
        group = rec.get("options", {}).get("group_size") or rec.get("weight_block")
        if group is None and SCHEMES[recipe.quantization].default_group_size:
            group = recipe.options.get("group_size") or SCHEMES[recipe.quantization].default_group_size
        if group is not None:
            if rec.get("options", {}).get("group_size") and group not in GROUP_SIZES:
                problems.append(f"{recipe.name}: group size {group} not offered ({GROUP_SIZES})")
            misfits = [f"{role} ({dim})" for role, dim in dims.items() if dim % group]
            if misfits:
                problems.append(f"{recipe.name}: group size {group} does not divide {', '.join(misfits)}")
        unknown = set(rec.get("options", {})) - set(recipe.options)
        if unknown:
            problems.append(f"{recipe.name}: options {sorted(unknown)} are not options of this recipe")
    return problems


def read_results(path: Path = ZOO_DIR / "results.json") -> list[CellResult]:
    return load_results(path).cells


TABLE_COLUMNS = ("model", "recipe", "backend", "status", "delegated %", "files MB", "job s", "peak RSS MB",
                 "decode tok/s", "engine", "ppl ratio", "weights", "reason")


def cell_figures(cell: CellResult) -> dict:
    """The figures a table shows for one cell; None where not measured."""
    measured = cell.measured
    return {
        "model": cell.model, "recipe": cell.recipe, "backend": cell.backend, "status": cell.status,
        "delegated %": measured.delegated_percent, "files MB": measured.files_mb, "job s": cell.seconds,
        "peak RSS MB": measured.peak_rss_mb, "decode tok/s": measured.decode_tokens_per_s,
        "engine": "export only" if cell.export_only else measured.engine,
        "ppl ratio": measured.perplexity_ratio if measured.perplexity_ratio is not None else measured.fidelity,
        "weights": cell.weights, "reason": cell.reason,
    }


def table_rows(cells: list[CellResult], backend: str | None = None) -> list[dict]:
    """Rows of the zoo table (one per cell), optionally one backend's."""
    return [cell_figures(c) for c in cells if backend in (None, "all", c.backend)]


def preferred_cell(cells: list[CellResult]) -> CellResult:
    """Of the cells of one model × recipe, a finished full job's first (it has decode and fidelity figures),
    then a finished export-only one; of equal ones, the one with the recipe's default algorithm (a cell may name
    another to compare), then the one measured on the newest executorch, then the latest (a matrix re-run after a
    version or option change adds cells beside the old ones)."""
    return max(cells, key=lambda c: (c.status == "ok", not c.export_only,
                                     "quant_algorithm" not in (c.options or {}), c.executorch_version,
                                     c.measured_at or c.date or ""))


def recommended_for(entry: ZooEntry, cells: list[CellResult]) -> list[dict]:
    """Each recommended recipe of a model with what the matrix measured for it (if anything)."""
    rows = []
    for backend, rec in entry.recommended.items():
        measured = [c for c in cells if c.model == entry.repo_id and c.recipe == rec["recipe"]]
        figures = cell_figures(preferred_cell(measured)) if measured else {"status": "not measured"}
        rows.append({"backend": backend, "recipe": rec["recipe"], "max context": rec["max_seq_len"],
                     "options": ", ".join(f"{k}={v}" for k, v in rec.get("options", {}).items()), "why": rec["why"],
                     **{k: v for k, v in figures.items() if k not in ("model", "recipe", "backend")}})
    return rows


def selection_for(entry: ZooEntry) -> dict:
    """What choosing a zoo model sets in the app: recommended recipe per backend, the smallest recommended
    context, the group size of the first recommendation that sets one (the app has one group-size field), and a
    line on license and gating."""
    recipes = {backend: rec["recipe"] for backend, rec in entry.recommended.items()}
    contexts = [rec["max_seq_len"] for rec in entry.recommended.values()]
    group = next((size for rec in entry.recommended.values() if (size := (rec.get("options") or {}).get("group_size"))),
                 None)
    access = (f"gated ({entry.license}): accept the license on the Hub and give a token"
              + (f", or use the ungated mirror `{entry.ungated_mirror}`" if entry.ungated_mirror else "")
              if entry.gated else f"ungated ({entry.license})")
    return {"repo_id": entry.repo_id, "builtin": entry.builtin, "recipes": recipes,
            "max_seq_len": min(contexts) if contexts else None, "group_size": group,
            "note": f"**{entry.title}** — {access}."}
