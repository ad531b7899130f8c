"""One recipe's quantization of the exportable module: its algorithm's fp32 transform, the mixed-precision
choice, then the scheme's torchao transform. Returns what the report records and the seconds of each part."""
from __future__ import annotations

import time

from quant.algorithms import ALGORITHM_CALIBRATION_TOKENS, AWQ_ALGORITHMS, CALIBRATED
from quant.calibration import CALIBRATION_TOKENS, calibration_windows, describe_calibration
from quant.schemes import SCHEMES, prepare_for_scheme, quant_args


def check_options(scheme: str, options: dict) -> None:
    """Refuses an algorithm or budget the scheme does not take, before the checkpoint is loaded."""
    from errors import UserFacingError
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


def quantize_module(module, scheme: str, options: dict, tokenizer, max_seq_len: int) -> tuple[dict, dict]:
    """In place. Returns (report section, seconds by part)."""
    from dataclasses import replace

    from quant.mixed_precision import choose_8bit_units, linear_weight_bytes

    spec = SCHEMES[scheme]
    algorithm = options.get("quant_algorithm") or spec.algorithms[0]
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
    """minmax and hqq quantize each weight on its own, so the module can be quantized piece by piece as it is
    built (one piece in float at a time); AWQ, SpinQuant and mixed precision look at the whole float model."""
    spec = SCHEMES[scheme]
    algorithm = options.get("quant_algorithm") or spec.algorithms[0]
    budget = float(options.get("mixed_precision_budget") or 0.0)
    return spec.apply is not None and spec.layerwise and algorithm not in WHOLE_MODEL_ALGORITHMS and not budget


WHOLE_MODEL_ALGORITHMS = ("awq", "spinquant", "gptq", "awq-gptq")


def unit_quantization_section(module, scheme: str, options: dict) -> dict:
    """The report section of a module quantized by unit (quantizes_by_unit)."""
    from quant.mixed_precision import linear_weight_bytes

    spec = SCHEMES[scheme]
    algorithm = options.get("quant_algorithm") or spec.algorithms[0]
    return {"scheme": scheme, "algorithm": algorithm if spec.int4_config else None,
            "weight_bytes_per_token": linear_weight_bytes(module)}
