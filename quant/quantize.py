"""One recipe's quantization of the exportable module: its algorithm's fp32 transform, the mixed-precision
choice, then the scheme's torchao transform. Returns what the report records and the seconds of each part."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

from quant.algorithms import ALGORITHM_CALIBRATION_TOKENS, AWQ_ALGORITHMS, CALIBRATED
from quant.calibration import CALIBRATION_TOKENS, calibration_windows, describe_calibration
from quant.schemes import SCHEMES, awq_search_config, prepare_for_scheme, quant_args


def check_options(scheme: str, options: dict) -> None:
    """Refuses an algorithm or budget the scheme does not take, before the checkpoint is loaded."""
    from models.errors import UserFacingError
    from quant.algorithms import check_algorithm

    spec = SCHEMES[scheme]
    algorithm = options.get("quant_algorithm")
    if algorithm is not None:
        check_algorithm(scheme, algorithm, spec.algorithms)
    budget = options.get("mixed_precision_budget")
    if budget and not spec.mixed_precision:
        raise UserFacingError(f"{scheme} takes no mixed-precision budget; leave it at 0.")
    if budget and not 0 < float(budget) <= 1:
        raise UserFacingError(
            f"mixed-precision budget {budget} is outside (0, 1]: give the extra bytes per token as a fraction, "
            "e.g. 0.1 for +10 %."
        )


def recipe_algorithm(scheme: str, options: dict) -> str:
    """The int4 algorithm a recipe's options ask for, the scheme's default when they name none."""
    return quant_args(scheme, algorithm=options.get("quant_algorithm")).algorithm


def quantize_module(module, scheme: str, options: dict, tokenizer, max_seq_len: int) -> tuple[dict, dict]:
    """In place. Returns (report section, seconds by part)."""
    from dataclasses import replace

    from quant.mixed_precision import choose_8bit_units, linear_weight_bytes

    spec = SCHEMES[scheme]
    algorithm = recipe_algorithm(scheme, options)
    budget = float(options.get("mixed_precision_budget") or 0.0)
    seconds: dict = {}
    section: dict = {"scheme": scheme, "algorithm": algorithm if spec.int4_config else None}
    windows = searched = []
    if algorithm in CALIBRATED or budget:
        tokens = ALGORITHM_CALIBRATION_TOKENS.get(algorithm, CALIBRATION_TOKENS)
        windows = calibration_windows(tokenizer, max_seq_len, tokens)
        # AWQ's search and the mixed-precision search read the default count, however many GPTQ reads
        searches = algorithm in AWQ_ALGORITHMS or budget
        searched = calibration_windows(tokenizer, max_seq_len) if searches and tokens != CALIBRATION_TOKENS else windows
        section["calibration"] = describe_calibration(windows, searched)
    args = quant_args(scheme, options.get("group_size"), algorithm, windows)
    started = time.perf_counter()
    prepare_for_scheme(module, scheme, replace(args, calibration=tuple(searched)))
    seconds["quant_algorithm"] = round(time.perf_counter() - started, 3)
    if budget:
        started = time.perf_counter()
        choice = choose_8bit_units(module, lambda m, units: spec.apply(m, replace(args, units_8bit=units)),
                                   searched, budget)
        seconds["mixed_precision_search"] = round(time.perf_counter() - started, 3)
        section["mixed_precision"] = choice
        args = replace(args, units_8bit=tuple(choice["units_8bit"]))
    if spec.apply is not None:
        started = time.perf_counter()
        spec.apply(module, args)
        seconds["quantize_transform"] = round(time.perf_counter() - started, 3)
    if spec.quantize_exported is None:  # a PT2E scheme quantizes the exported program later
        section["weight_bytes_per_token"] = linear_weight_bytes(module)
    return section, seconds


def quantizes_by_unit(scheme: str, options: dict) -> bool:
    """minmax and hqq quantize each weight on its own, and AWQ searches a decoder layer from the hidden states
    entering it, so the module can be quantized piece by piece as it is built (one piece in float at a time);
    SpinQuant, GPTQ and mixed precision look at the whole float model."""
    spec = SCHEMES[scheme]
    budget = float(options.get("mixed_precision_budget") or 0.0)
    algorithm = recipe_algorithm(scheme, options)
    return spec.apply is not None and spec.layerwise and algorithm not in WHOLE_MODEL_ALGORITHMS and not budget


WHOLE_MODEL_ALGORITHMS = ("spinquant", "gptq", "awq-gptq")


def by_unit_awq(scheme: str, options: dict) -> bool:
    """Whether the scheme quantizes by unit with AWQ's search on each decoder layer (UnitQuantizer)."""
    return quantizes_by_unit(scheme, options) and recipe_algorithm(scheme, options) in AWQ_ALGORITHMS


class UnitQuantizer:
    """build_exportable's transform_unit for a recipe that quantizes_by_unit: the algorithm's fp32 transform
    of the unit (AWQ's scales for a decoder layer, quant.awq.AwqAsBuilt), then the scheme's."""

    def __init__(self, scheme: str, options: dict, tokenizer, max_seq_len: int,
                 around_search: Callable[[], ContextManager] = contextlib.nullcontext):
        from quant.awq import AwqAsBuilt

        self.scheme, self.group_size = scheme, options.get("group_size")
        self.algorithm = recipe_algorithm(scheme, options)
        self.calibration = None
        self.awq = None
        self._awq_seconds = 0.0
        # entered around each decoder layer's search: the caller's heap policy (the search's candidates come
        # back at the same sizes, so what it frees can be reused and returned before the next unit)
        self.around_search = around_search
        if by_unit_awq(scheme, options):
            windows = calibration_windows(tokenizer, max_seq_len)
            self.calibration = describe_calibration(windows)
            self.awq = AwqAsBuilt(awq_search_config(scheme, self.group_size), windows)

    def __call__(self, unit, module) -> None:
        from quant.schemes import apply_scheme_by_rows

        if self.awq is not None:
            started = time.perf_counter()
            with self.around_search():
                self.awq(unit, module)
            self._awq_seconds += time.perf_counter() - started
        apply_scheme_by_rows(unit, self.scheme, self.group_size, algorithm=self.algorithm)

    @property
    def seconds(self) -> dict:
        """Seconds by part, as quantize_module returns them: the time AWQ's search added."""
        return {"quant_algorithm": round(self._awq_seconds, 3)} if self.awq is not None else {}

    def section(self, module) -> dict:
        """The report section of the module it quantized."""
        from quant.mixed_precision import linear_weight_bytes

        spec = SCHEMES[self.scheme]
        section = {"scheme": self.scheme, "algorithm": self.algorithm if spec.int4_config else None}
        if self.calibration is not None:
            section["calibration"] = self.calibration
        section["weight_bytes_per_token"] = linear_weight_bytes(module)
        return section
