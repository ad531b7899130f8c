"""What a job will cost in memory and disk, and whether it would be refused, from the model's config alone: the
figures the app shows before the Lower button is pressed (its time comes from recipes/estimates/time_estimate.py)."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from models.errors import UserFacingError
from quant.quantize import check_options
from quant.schemes import check_group_size
from recipes.estimates.memory_estimate import check_job_fits, estimate_job, memory_budget, parameter_count
from recipes.request import check_limits, recipe_defaults


@dataclass(frozen=True)
class JobCost:
    peak_bytes: int
    peak_stage: str
    budget_bytes: int
    budget_where: str  # where the budget comes from (free RAM, or LOWERBENCH_MEMORY_LIMIT_GB)
    refusal: str | None  # the message the job would be refused with, naming what would fit; None: it fits
    download_bytes: int  # the weights to fetch (0: local, or already in the Hugging Face cache)
    output_bytes: int  # the .pte files
    download_free_bytes: int | None  # free space where each goes; None where nothing goes
    output_free_bytes: int
    parameters: int


def recipe_options_for(recipes: list, given: dict) -> dict:
    """Recipe name -> its options: its defaults with the given ones it takes, as the job will run it."""
    found = {}
    for recipe in recipes:
        defaults = recipe_defaults(recipe)
        found[recipe.name] = {**defaults, **{k: v for k, v in given.items() if k in defaults}}
    return found


def check_recipe_options(recipes: list, options: dict) -> None:
    """The refusals the job makes of its options before loading anything."""
    for recipe in recipes:
        check_group_size(recipe.quantization, options[recipe.name].get("group_size"))
        check_options(recipe.quantization, options[recipe.name])
        recipe.backend.check_options(options[recipe.name])


def job_cost(config, recipes: list, options: dict, max_seq_len: int, generate: bool, outputs_dir: Path,
             download_dir: Path | None) -> JobCost:
    """download_dir: where the weights would be downloaded to (the Hugging Face cache), None when nothing is."""
    budget, where = memory_budget()
    estimate = estimate_job(config, recipes, max_seq_len, generate, budget, options)
    try:
        check_limits(config, recipes, max_seq_len, options)
        check_job_fits(config, recipes, max_seq_len, generate, options)
        refusal = None
    except UserFacingError as err:
        refusal = str(err)
    return JobCost(estimate.peak_rss_bytes, estimate.peak_stage, budget, where, refusal,
                   estimate.checkpoint_bytes if download_dir is not None else 0, estimate.disk_bytes,
                   free_bytes(download_dir) if download_dir is not None else None, free_bytes(outputs_dir),
                   parameter_count(config))


def free_bytes(folder: Path) -> int:
    """Free space on the disk a folder is (or would be created) on."""
    folder = Path(folder).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free
