"""One recipe's quantization of the exportable module: its algorithm's fp32 transform, the mixed-precision
choice, then the scheme's torchao transform. Returns what the report records and the seconds of each part."""
from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Callable, ContextManager

from models.errors import UserFacingError
from quant.algorithms import ALGORITHMS, UNAVAILABLE
from quant.calibration import CALIBRATION_TOKENS, calibration_windows, describe_calibration
from quant.calibration_file import CalibrationFile
from quant.mixed_precision import choose_8bit_units, linear_weight_bytes
from quant.schemes import SCHEMES, apply_scheme_by_rows, prepare_for_scheme, quant_args, search_config


def check_algorithm(scheme: str, algorithm: str, offered: tuple[str, ...]) -> None:
    """Refuses an algorithm the scheme does not offer, saying why when that is known."""
    if algorithm in offered:
        return
    why = UNAVAILABLE.get(algorithm)
    record = ALGORITHMS.get(algorithm)
    spec = SCHEMES[scheme]
    if why is None and record is not None:
        if spec.int4_config is None:
            why = f"{scheme} has no int4 group-wise weights"
        elif spec.channelwise_int4 and record.gptq_integers:
            why = f"{scheme} has one int4 scale per output channel; GPTQ here chooses its integers group by group"
        elif spec.quantize_exported is not None and record.pt2e_refusal:
            why = record.pt2e_refusal.format(scheme=scheme)
        elif spec.quantize_exported is not None and record.gptq_integers:
            why = (f"{scheme}'s PT2E quantizer sets the qparams from its observers after the float weights are "
                   "fixed; GPTQ chooses the integers itself")
        elif spec.quantize_exported is not None:
            why = (f"the backend's PT2E quantizer sets {scheme}'s qparams from its observers; only algorithms that "
                   "transform the float weights before it are offered")
    raise UserFacingError(
        f"quant algorithm {algorithm!r} is not offered for {scheme}" + (f" ({why})" if why else "")
        + f"; choose one of: {', '.join(offered)}."
    )


def check_options(scheme: str, options: dict) -> None:
    """Refuses an algorithm or budget the scheme does not take, before the checkpoint is loaded."""
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


def calibration_tokens_read(scheme: str, options: dict) -> int | None:
    """The calibration tokens a recipe reads (None: none): its algorithm's, the mixed-precision search's, or a
    PT2E scheme's calibration calls'. A calibration file shorter than this is refused."""
    algorithm = ALGORITHMS[recipe_algorithm(scheme, options)]
    if algorithm.calibrated:
        return algorithm.calibration_tokens
    if float(options.get("mixed_precision_budget") or 0.0) or SCHEMES[scheme].quantize_exported is not None:
        return CALIBRATION_TOKENS
    return None


def _search_products(algorithm) -> str | None:
    return algorithm.search_products() if algorithm.search_products else None


def quantize_module(module, scheme: str, options: dict, tokenizer, max_seq_len: int,
                    calibration_file: CalibrationFile | None = None) -> tuple[dict, dict]:
    """In place. Returns (report section, seconds by part). calibration_file: a tokenized one read in place of the
    built-in calibration text."""
    spec = SCHEMES[scheme]
    name = recipe_algorithm(scheme, options)
    algorithm = ALGORITHMS[name]
    budget = float(options.get("mixed_precision_budget") or 0.0)
    seconds: dict = {}
    section: dict = {"scheme": scheme, "algorithm": name if spec.int4_config else None}
    windows = searched = []
    if algorithm.calibrated or budget:
        tokens = algorithm.calibration_tokens or CALIBRATION_TOKENS
        windows = calibration_windows(tokenizer, max_seq_len, tokens, calibration_file)
        # a search (the fp32 transform's, the mixed-precision one) reads the default count, however many GPTQ reads
        searches = algorithm.prepare_module is not None or budget
        searched = (calibration_windows(tokenizer, max_seq_len, file=calibration_file)
                    if searches and tokens != CALIBRATION_TOKENS else windows)
        section["calibration"] = describe_calibration(windows, searched, _search_products(algorithm),
                                                      calibration_file)
    args = quant_args(scheme, options.get("group_size"), name, windows)
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


def cast_quantized(module, scheme: str):
    """The quantized module in the scheme's final dtype (Scheme.cast_to): torchao's int tensors keep their integers
    and cast their scales; the norms still compute in fp32."""
    dtype = SCHEMES[scheme].cast_to
    if dtype is None:
        return module
    module.to(dtype)
    module.options = replace(module.options, dtype=dtype)
    return module


def quantizes_by_unit(scheme: str, options: dict) -> bool:
    """Whether the module can be quantized piece by piece as it is built (one piece in float at a time): each
    weight is quantized on its own, and the algorithm's fp32 transform, if any, has a by-unit form (AWQ searches
    a decoder layer from the hidden states entering it). An algorithm that needs the whole float model
    (SpinQuant's rotations, GPTQ) and mixed precision take the whole module."""
    spec = SCHEMES[scheme]
    budget = float(options.get("mixed_precision_budget") or 0.0)
    algorithm = ALGORITHMS[recipe_algorithm(scheme, options)]
    return spec.apply is not None and spec.layerwise and not algorithm.whole_model and not budget


def transforms_by_unit(scheme: str, options: dict) -> bool:
    """Whether the scheme quantizes by unit with its algorithm's fp32 transform made on each unit (UnitQuantizer)."""
    algorithm = ALGORITHMS[recipe_algorithm(scheme, options)]
    return (quantizes_by_unit(scheme, options) and SCHEMES[scheme].int4_config is not None
            and algorithm.prepare_by_unit is not None)


class UnitQuantizer:
    """build_exportable's transform_unit for a recipe that quantizes_by_unit: the algorithm's fp32 transform
    of the unit (AWQ's scales for a decoder layer, quant.awq.AwqAsBuilt), then the scheme's."""

    def __init__(self, scheme: str, options: dict, tokenizer, max_seq_len: int,
                 around_search: Callable[[], ContextManager] = contextlib.nullcontext,
                 around_scheme: Callable[[], ContextManager] = contextlib.nullcontext,
                 calibration_file: CalibrationFile | None = None):
        if not quantizes_by_unit(scheme, options):
            raise ValueError(f"{scheme} with {options} quantizes the whole float module: use quantize_module")
        self.scheme, self.group_size = scheme, options.get("group_size")
        self.algorithm = recipe_algorithm(scheme, options)
        self.calibration = None
        self.transform = None
        self._transform_seconds = 0.0
        # entered around the transform of each unit (AWQ's search of a decoder layer): the caller's heap policy
        # (the search's candidates come back at the same sizes, so what it frees can be reused and returned
        # before the next unit)
        self.around_search = around_search
        # entered around the scheme's quantization of each unit: the caller's heap policy (HQQ's fit asks for and
        # frees blocks of the same sizes thousands of times a unit)
        self.around_scheme = around_scheme
        if transforms_by_unit(scheme, options):
            algorithm = ALGORITHMS[self.algorithm]
            windows = calibration_windows(tokenizer, max_seq_len, file=calibration_file) if algorithm.calibrated else []
            if algorithm.calibrated:
                self.calibration = describe_calibration(windows, search_products=_search_products(algorithm),
                                                        file=calibration_file)
            self.transform = algorithm.prepare_by_unit(search_config(scheme, self.group_size), windows)

    def __call__(self, unit, module) -> None:
        if self.transform is not None:
            started = time.perf_counter()
            with self.around_search():
                self.transform(unit, module)
            self._transform_seconds += time.perf_counter() - started
        with self.around_scheme():
            apply_scheme_by_rows(unit, self.scheme, self.group_size, algorithm=self.algorithm)

    @property
    def seconds(self) -> dict:
        """Seconds by part, as quantize_module returns them: the time the algorithm's transform added."""
        return {"quant_algorithm": round(self._transform_seconds, 3)} if self.transform is not None else {}

    def section(self, module) -> dict:
        """The report section of the module it quantized."""
        spec = SCHEMES[self.scheme]
        section = {"scheme": self.scheme, "algorithm": self.algorithm if spec.int4_config else None}
        if self.calibration is not None:
            section["calibration"] = self.calibration
        section["weight_bytes_per_token"] = linear_weight_bytes(module)
        return section
