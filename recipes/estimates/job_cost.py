"""What a job will cost before it runs, and whether it would be refused, from the model's config alone: one
JobEstimate (recipes/output/report.py) of its memory and disk (recipes/estimates/memory_estimate.py) and each
recipe's time (recipes/estimates/time_estimate.py). The job checks it before any weight is read and its reports keep
it; the app sets it against this host's memory and disks before the Lower button is pressed."""
from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from models.errors import UserFacingError
from recipes.estimates.host_speed import host_speed
from recipes.estimates.memory_estimate import check_job_fits, estimate_job, memory_budget, parameter_count
from recipes.estimates.time_estimate import estimate_time
from recipes.output.report import JobEstimate
from recipes.request import check_limits


def with_time(estimate: JobEstimate, config, recipes: list, options: dict, generate: bool) -> JobEstimate:
    """The estimate with each recipe's seconds on this host and the notes on them, from the zoo's cells;
    ValueError when the zoo has no cell measured stage by stage to time it from."""
    times, notes = estimate_time(parameter_count(config), recipes, options, generate, host_speed())
    return replace(estimate, recipes=[replace(row, time=time) for row, time in zip(estimate.recipes, times)],
                   time_notes=notes)


@dataclass
class JobEstimateCheck:
    """check_job_fits for one job, keeping its latest estimate with each recipe's time: called with the config
    before any weight is read (models.sources.checkpoint.load_checkpoint's check_config), and again with the
    evaluation texts' token counts once the tokenizer is read."""
    recipes: list
    max_seq_len: int
    generate: bool
    options: dict | None = None  # recipe name -> its options
    layer_map: bool = False
    estimate: JobEstimate | None = None

    def __call__(self, config, eval_tokens: list[int] | None = None) -> None:
        estimate = check_job_fits(config, self.recipes, self.max_seq_len, self.generate, self.options, eval_tokens,
                                  self.layer_map)
        try:
            self.estimate = with_time(estimate, config, self.recipes, self.options or {}, self.generate)
        except ValueError:  # a zoo without cells measured stage by stage gives no time; the job runs without one
            self.estimate = estimate


@dataclass(frozen=True)
class JobCost:
    """The job's estimate set against this host: what the app shows before the Lower button is pressed."""
    estimate: JobEstimate  # memory, disk and, unless time_unknown says why not, time
    parameters: int
    budget_bytes: int
    budget_where: str  # where the budget comes from (free RAM, or LOWERBENCH_MEMORY_LIMIT_GB)
    refusal: str | None  # the message the job would be refused with, naming what would fit; None: it fits
    download_bytes: int  # the weights to fetch (0: local, or already in the Hugging Face cache)
    download_free_bytes: int | None  # free space where each goes; None where nothing goes
    output_free_bytes: int
    time_unknown: str | None  # why there is no time estimate (no zoo cell to time it from)


def job_cost(config, recipes: list, options: dict, max_seq_len: int, generate: bool, outputs_dir: Path,
             download_dir: Path | None) -> JobCost:
    """options: recipe name -> its options (recipes/request.py: recipe_options). download_dir: where the weights
    would be downloaded to (the Hugging Face cache), None when nothing is."""
    budget, where = memory_budget()
    estimate = estimate_job(config, recipes, max_seq_len, generate, budget, options)
    try:
        check_limits(config, recipes, max_seq_len, options)
        check_job_fits(config, recipes, max_seq_len, generate, options)
        refusal = None
    except UserFacingError as err:
        refusal = str(err)
    try:
        estimate, time_unknown = with_time(estimate, config, recipes, options, generate), None
    except ValueError as err:
        time_unknown = str(err)
    return JobCost(estimate, parameter_count(config), budget, where, refusal,
                   estimate.checkpoint_bytes if download_dir is not None else 0,
                   free_bytes(download_dir) if download_dir is not None else None, free_bytes(outputs_dir),
                   time_unknown)


def free_bytes(folder: Path) -> int:
    """Free space on the disk a folder is (or would be created) on."""
    folder = Path(folder).resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free
