"""The int4 algorithms, one record each: how an int4 scheme picks its weights and qparams (the `quant_algorithm`
recipe option). The schemes' choices, the whole-model or piece-by-piece path, the calibration a recipe reads,
the memory estimate, the CLI's help and the app's dropdown all read this table; each algorithm's own code is in
its module (quant/awq.py, quant/spinquant.py, quant/gptq.py, quant/hqq.py).

Every algorithm ends in the same torchao tensors (int4 groups with one scale each), so the program, its ops
and its bytes per token are those of `minmax`; only the numbers differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from quant.awq import AWQ_SEARCH_COPIES, AwqAsBuilt, apply_awq, search_products
from quant.calibration import CALIBRATION_TOKENS
from quant.gptq import GPTQ_CALIBRATION_TOKENS
from quant.spinquant import apply_spinquant

# The qparams of an algorithm's final int4 groups, as values of torchao's IntxChooseQParamsAlgorithm.
AFFINE = "affine"  # each group's scale from its min/max (choose_qparams_affine)
HQQ_SCALE_ONLY = "hqq_scale_only"  # HQQ's scale-only optimisation of each group's scale (quant/hqq.py)


@dataclass(frozen=True)
class Algorithm:
    """One int4 algorithm. Which path a recipe's module takes follows from it: the module is quantized piece by
    piece as it is built (quant.quantize.UnitQuantizer) unless the algorithm needs the whole float model."""

    name: str
    description: str  # one line: the CLI's --quant-algorithm help and the app's dropdown
    # Its fp32 transform of the whole float module before the scheme quantizes it, in place:
    # (module, search config, calibration windows) -> None. The search config is the torchao config a search
    # quantizes its candidates with (quant.schemes.search_config).
    prepare_module: Callable[..., None] | None = None
    # The same transform made one unit at a time as models.llama.build_exportable fills the module:
    # (search config, calibration windows) -> its transform_unit, (unit, module) -> None. Without it, an
    # algorithm with a whole-module transform needs the whole float model.
    prepare_by_unit: Callable[..., Callable[..., None]] | None = None
    # fp32 copies of a decoder layer's widest linears (gate and up together) the by-unit transform holds beside
    # the float layer it works on (recipes/estimates/memory_estimate.py)
    unit_search_copies: int = 0
    # Tokens of the calibration text it reads (None: not calibrated). A search, its fp32 transform's or the
    # mixed-precision one, reads quant.calibration.CALIBRATION_TOKENS of them.
    calibration_tokens: int | None = None
    # The dtype its search's products are computed in on this CPU (the report's calibration.search_products)
    search_products: Callable[[], str] | None = None
    qparams: str = AFFINE  # of its final int4 groups
    # GPTQ chooses the integers of its int4 linears (quant/gptq.py), layer after layer of the whole float model
    gptq_integers: bool = False
    groupwise_int4: bool = True  # offered by the int4 group-wise source schemes (8da4w, 8da4w-emb4, int4-weight)
    pt2e_int4: bool = False  # offered by the PT2E int4 scheme (16a4w), whose quantizer sets the qparams
    # Why a PT2E scheme does not offer it, when the reason is the algorithm's own ({scheme}: the scheme's name)
    pt2e_refusal: str | None = None

    def __post_init__(self):
        if self.prepare_by_unit is not None and self.prepare_module is None:
            raise ValueError(f"{self.name}: a by-unit transform needs its whole-module form too (mixed precision "
                             "and PT2E schemes prepare the whole module)")

    @property
    def whole_model(self) -> bool:
        """Needs the whole float model: its transform has no by-unit form, or GPTQ chooses its integers."""
        return (self.prepare_module is not None and self.prepare_by_unit is None) or self.gptq_integers

    @property
    def calibrated(self) -> bool:
        return self.calibration_tokens is not None


# In the order the schemes offer them: the first a scheme takes is its default, chosen by measurement on the
# built-in model (docs/quantization.md): the most faithful within the same program and bytes whose quantize time
# stays within twice minmax's plus a minute. That is AWQ (GPTQ takes minutes), for every int4 scheme; its fast
# search keeps an export-only job within half of optimum-cli's time at Llama-3.2-1B's and 3B's shapes.
ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    # AWQ's search of each decoder layer's scales on the calibration text, torchao's candidates (quant/awq.py);
    # folded into the op before each linear, they add no op. They change which weights matter,
    # not how a group's scale is fitted, so HQQ's fit still helps after them (measured on the built-in model).
    Algorithm("awq", "activation-aware weight scales searched on the calibration text (AWQ on torchao), folded into "
                     "norms, then HQQ scale-only qparams",
              prepare_module=apply_awq, prepare_by_unit=AwqAsBuilt, unit_search_copies=AWQ_SEARCH_COPIES,
              calibration_tokens=CALIBRATION_TOKENS, search_products=search_products, qparams=HQQ_SCALE_ONLY,
              pt2e_int4=True),
    Algorithm("hqq", "HQQ scale-only qparams (torchao)", qparams=HQQ_SCALE_ONLY),
    Algorithm("minmax", "scales from each group's min/max", pt2e_int4=True),
    # quant/spinquant.py; the rotations take neither a search config nor calibration
    Algorithm("spinquant", "SpinQuant R1 + R2 Hadamard rotations (torchao), exact in fp32",
              prepare_module=lambda module, search_config, windows: apply_spinquant(module),
              pt2e_refusal="SpinQuant's rotations gave a larger error than minmax under {scheme}'s PT2E quantizer, "
                           "whose 16-bit activations leave it only the weights' outliers to spread"),
    # GPTQ's column-by-column error compensation against each linear's Hessian (quant/gptq.py)
    Algorithm("gptq", "GPTQ error compensation on the calibration text's Hessians, layer by layer, each layer's "
                      "linears in call order",
              calibration_tokens=GPTQ_CALIBRATION_TOKENS, gptq_integers=True),
    Algorithm("awq-gptq", "AWQ's scales (torchao) folded in, then GPTQ",
              prepare_module=apply_awq, calibration_tokens=GPTQ_CALIBRATION_TOKENS, search_products=search_products,
              gptq_integers=True),
)}

# Asked for, not offered on this stack, and why.
UNAVAILABLE: dict[str, str] = {
    "spinquant-r4": "SpinQuant's R4 needs an online Hadamard transform before down_proj, an op the program does not "
                    "have; spinquant applies R1 and R2, which fold into the weights",
}

# The algorithm of a scheme without int4 groups: its weights' qparams from their min/max, and nothing else.
PLAIN_ALGORITHM = "minmax"
# What a search (AWQ's) quantizes each candidate with: min/max groups, because HQQ's fit inside every one of
# its candidates would repeat the whole HQQ pass once per candidate.
SEARCH_QPARAMS = AFFINE
# What a job refused for memory is pointed to: no calibration search, piece by piece.
LIGHTEST_ALGORITHM = "hqq"


def offered_algorithms(pt2e: bool) -> tuple[str, ...]:
    """The algorithms an int4 scheme offers (a PT2E one, or a group-wise source scheme), its default first."""
    return tuple(name for name, algorithm in ALGORITHMS.items()
                 if (algorithm.pt2e_int4 if pt2e else algorithm.groupwise_int4))


def prepare_weights(module, algorithm: str, search_config, calibration) -> None:
    """The algorithm's fp32 transform of the whole module before the scheme quantizes it, if it has one."""
    record = ALGORITHMS[algorithm]
    if record.prepare_module is None:
        return
    if record.calibrated and not calibration:
        raise ValueError(f"{algorithm} needs calibration windows")
    record.prepare_module(module, search_config, list(calibration or ()))
