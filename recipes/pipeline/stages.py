"""A job's stages: progress and cancellation between them, and each stage's seconds and peak RSS for the report."""
from __future__ import annotations

import resource
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from models.errors import UserFacingError
from recipes.process import malloc_policy
from recipes.process import rss
from recipes.output.report import Timings

Progress = Callable[[float, str], None]


class Cancelled(UserFacingError):
    pass


@dataclass
class Figures:
    """Where stages' figures land: each stage's seconds (a report's timings_s) and its peak RSS in MB (a report's
    memory.peak_rss_mb_by_stage). The job's shared stages have their own, copied into each recipe's."""
    timings: Timings = field(default_factory=Timings)
    peaks: dict[str, float | None] = field(default_factory=dict)


class Stages:
    """Progress reporting and cancellation between stages, and each stage's figures."""

    def __init__(self, progress: Progress | None, cancel: threading.Event | None, total: int):
        self.progress, self.cancel, self.total, self.done = progress, cancel, total, 0

    def begin(self, message: str) -> float:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the job was cancelled; nothing was written for unfinished recipes.")
        if self.progress:
            self.progress(min(self.done / self.total, 0.99), message)
        malloc_policy.trim_freed_heap()
        rss.mark()
        return time.perf_counter()

    def end(self, started: float, figures: Figures, stage: str) -> None:
        figures.timings.add(stage, time.perf_counter() - started)
        peak_mb = rss.peak_bytes() / rss.MB
        figures.peaks[stage] = max(figures.peaks.get(stage) or 0.0, round(peak_mb, 1))
        self.done += 1

    @contextmanager
    def stage(self, message: str, figures: Figures, stage: str) -> Iterator[None]:
        """begin() and, when the body returns, end(); a stage that raises records nothing."""
        started = self.begin(message)
        yield
        self.end(started, figures, stage)


def peak_rss_mb(stage_peaks: dict[str, float | None]) -> float:
    """The job's peak: its stages' (Linux resets the high-water mark for each, which ru_maxrss then misses)
    or the lifetime peak, whichever is higher."""
    lifetime = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return round(max([lifetime, *(v for v in stage_peaks.values() if v is not None)]), 1)
