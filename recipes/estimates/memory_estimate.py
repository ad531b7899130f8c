"""How much memory and disk a job will take, from the model's config alone, before any weight is read or
downloaded; and the refusal of a job that cannot fit.

A job's stages run one after another in one process, so its peak is the largest stage's. Each stage holds
what the job keeps (the quantized modules of earlier recipes, the reference logits) plus its own working
set, which the constants below give as ratios to the bytes it works on, measured stage by stage
(recipes/process/rss.py; the peaks in zoo/results.json, measured by `python -m zoo matrix`). A backend's
lowering differs most, so its ratio is the backend's own `lowering_memory_ratio` (recipes/<backend>.py).

The estimate is the report's JobEstimate (recipes/output/report.py), as memory.estimate records it; each recipe's
time is added by recipes/estimates/job_cost.py."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from models.errors import UserFacingError
from models.families import module_shape
from models.llama import kv_cache_bytes
from quant.algorithms import ALGORITHMS, LIGHTEST_ALGORITHM
from quant.calibration import CALIBRATION_TOKENS
from quant.quantize import quantizes_by_unit, recipe_algorithm, transforms_by_unit
from quant.schemes import SCHEMES
from recipes.process import rss
from recipes.evaluation.fidelity import EVAL_TEXT, HELDOUT_TEXT
from recipes.output.report import JobEstimate, RecipeEstimate

GB = 1e9
LIMIT_ENV = "LOWERBENCH_MEMORY_LIMIT_GB"

# The process before any model: Python, torch, ExecuTorch, torchao and transformers imported.
BASE_BYTES = 0.45 * GB
# Working set of each stage as a multiple of what it works on:
# quantizing: the unit being built (the output layer, for these vocabularies) in fp32, its quantized rows and
# their concatenation (quant.schemes.apply_scheme_by_rows), over the module quantized so far;
QUANTIZE_TRANSIENT = 1.5
# export: torch.export's copies, over the quantized module; a strict export's (Dynamo's) trace also copies the
# weights for a while (Backend.strict_export);
EXPORT_RATIO = 0.15
STRICT_EXPORT_RATIO = 1.35
# generation on the runtime: the program loaded from the .pte file, over the .pte.
RUNTIME_RATIO = 1.0
# the profile's event-traced pass (recipes/running/profile.py): its load of the program, the delegates' initialized state
# and the event buffers (the timed run's program and the quantized module are released). A program whose linears
# are float has them packed again into XNNPACK's kernel layout when it loads; a quantized one mostly does not.
# Fitted to the zoo's full jobs: 135M and 360M xnnpack-fp32 (profile the peak, once the lowering's cycles are
# collected before the runtime loads: recipes/collector_policy.py) and Llama-3.2-3B's shape xnnpack-8da4w
# (profile stage 4.1 GB, 1.23x its 2.2 GB program over what the job held).
PROFILE_RATIO_FLOAT = 1.2
PROFILE_RATIO_QUANTIZED = 1.25
PROFILE_FIXED = 0.35 * GB  # the runtime, the delegates' workspace and the event buffers
# Tokens of the fidelity texts per character (quant/eval_text*.txt; Llama-family tokenizers make about 0.25), until
# the tokenizer is read and gives the count (recipes/pipeline/run.py).
EVAL_TOKENS_PER_CHAR = 0.3
PREFILL_LOGITS = 1  # the one prefill window of logits alive at a time, in fp32
# quantizing with an algorithm that looks at the whole float model (SpinQuant, GPTQ, mixed precision;
# quant/quantize.py): the float module built whole, and the calibration passes' activations and searches, over it.
WHOLE_MODEL_TRANSIENT = 1.0


@dataclass(frozen=True)
class _Weights:
    linears: int  # weights of the decoder layers' linears
    embedding: int
    output: int  # lm_head: its own copy when tied (Lowerbench quantizes it apart from the embedding)
    largest_unit: int  # weights of the largest piece the module is built in
    tied: bool
    per_layer: int  # weights of one decoder layer's linears
    layers: int


def _lowering_bytes(recipe, w: _Weights, pte: float, pte_lin: float, options: dict) -> float:
    """What lowering adds over the exported program: the recipe's own ratio to the .pte if it has one, else
    the backend's per-weight figures or its ratio, over the backend's base. A backend that compiles the
    decoder in shards works on the largest shard at a time: its layers and the output layer."""
    backend = recipe.backend
    if recipe.lowering_memory_ratio is None and backend.lowering_memory_per_weight is not None:
        per_linear, per_vocab = backend.lowering_memory_per_weight
        working = per_linear * w.linears + per_vocab * (w.embedding + w.output)
    else:
        layers = backend.layers_compiled_at_once(options)
        compiled = pte if layers is None else (min(layers, w.layers) * w.per_layer + w.output) * pte_lin
        working = compiled * (recipe.lowering_memory_ratio or backend.lowering_memory_ratio)
    working *= 1 + backend.lowering_memory_per_method * (_methods(recipe) - 1)
    return backend.lowering_memory_base_bytes + working + backend.lowering_memory_per_layer_bytes * w.layers


def module_runs_again(recipe, generate: bool, layer_map: bool) -> bool:
    """Whether a job runs the quantized module after its program is lowered: eager generation where the program
    cannot run here, or the per-layer error map. Otherwise recipes/pipeline/run.py releases it before the program is loaded,
    and the estimate counts it no longer."""
    return generate and (recipe.backend.cannot_run_here() is not None or layer_map)


def _methods(recipe) -> int:
    """Programs the recipe exports and lowers together: a static recipe's prefill and decode, else one."""
    return 2 if recipe.static_io else 1


def _weights(config) -> _Weights:
    s = module_shape(config)
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    per_layer = s.hidden * (q + 2 * kv) + q * s.hidden + 3 * s.hidden * s.intermediate
    embedding = s.vocab_size * s.hidden
    return _Weights(per_layer * s.n_layers, embedding, embedding, max(per_layer, embedding),
                    bool(getattr(config, "tie_word_embeddings", False)),
                    per_layer, s.n_layers)


def parameter_count(config) -> int:
    """The weights of a Llama with this config (norms aside), a tied output layer counted once."""
    w = _weights(config)
    return w.linears + w.embedding + (0 if w.tied else w.output)


def checkpoint_dtype(config) -> torch.dtype:
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(name, torch.dtype):
        return name
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(name).replace("torch.", ""), torch.float32)


def _eval_tokens() -> list[int]:
    """Tokens of each fidelity text (the evaluation text and the held-out one), guessed from their length."""
    return [int(len(Path(text).read_text()) * EVAL_TOKENS_PER_CHAR) for text in (EVAL_TEXT, HELDOUT_TEXT)]


def pte_bytes(config, recipe) -> int:
    """The recipe's .pte (and .ptd) bytes for a model of this config."""
    w = _weights(config)
    pte_lin, pte_emb = recipe.pte_bytes or SCHEMES[recipe.quantization].pte_bytes
    return int((w.linears + w.output) * pte_lin + w.embedding * pte_emb)


def _kv_cache_bytes(config, max_seq_len: int, dtype_bytes: int) -> int:
    s = module_shape(config)
    return 2 * s.n_layers * max_seq_len * s.n_kv_heads * s.head_dim * dtype_bytes


def _recipe_cache_bytes(config, recipe, max_seq_len: int, options: dict) -> int:
    """A recipe's caches as its module and its program hold them: their rows (a ring's, or max_seq_len) in
    their storage dtype, int8 with its scales and zero points. An aten-SDPA form also keeps a bool causal mask
    [max_seq_len, max_seq_len]."""
    form = recipe.export_options(max_seq_len, options)
    mask = max_seq_len * max_seq_len if form.attention == "sdpa" else 0
    return kv_cache_bytes(module_shape(config), form) + mask


def estimate_job(config, recipes: list, max_seq_len: int, generate: bool,
                 budget_bytes: int | None = None, options: dict | None = None,
                 eval_tokens: list[int] | None = None, layer_map: bool = False) -> JobEstimate:
    """Peak RSS and output disk of running `recipes` (registry Recipes) on a model with this config.
    With generation, the eager reference computes in fp32 on the checkpoint's own weights (a half-precision
    checkpoint's matrices stay in its dtype, models/compute_dtype.py) when that fits in `budget_bytes` (default:
    this host's, see memory_budget), else in the checkpoint's own dtype. options: recipe name -> its options
    (recipes/request.py: recipe_options), which say whether it quantizes the whole float model at once.
    eval_tokens: the fidelity texts' token counts by the model's tokenizer, once it is read (a tokenizer made
    for a random checkpoint can make twice the usual count, and every token keeps a row of logits).
    layer_map: the per-layer error map is asked for, which runs the quantized module after its program."""
    if generate:
        budget = memory_budget()[0] if budget_bytes is None else budget_bytes
        stored = checkpoint_dtype(config)
        fp32 = _estimate(config, recipes, max_seq_len, _Reference(torch.float32, stored), options, eval_tokens,
                         layer_map)
        if fp32.peak_rss_bytes <= budget or stored == torch.float32:
            return fp32
        whole = _estimate(config, recipes, max_seq_len, _Reference(stored, stored), options, eval_tokens, layer_map)
        if whole.peak_rss_bytes <= budget:
            return whole
        layer_major = _estimate(config, recipes, max_seq_len, _Reference(torch.float32, torch.float32, True), options,
                                eval_tokens, layer_map)
        return layer_major if layer_major.peak_rss_bytes < whole.peak_rss_bytes else whole
    return _estimate(config, recipes, max_seq_len, None, options)


@dataclass(frozen=True)
class _Reference:
    """How the eager reference would run."""
    dtype: torch.dtype  # what it computes in
    weight_dtype: torch.dtype  # what it keeps its decoder layers' matrices in (models/compute_dtype.py)
    # the texts scored one unit at a time from the checkpoint (recipes/evaluation/layer_major_reference.py)
    layer_major: bool = False


def _estimate(config, recipes: list, max_seq_len: int, reference: _Reference | None, options: dict | None = None,
              eval_tokens: list[int] | None = None, layer_map: bool = False) -> JobEstimate:
    """reference: None without generation."""
    w = _weights(config)
    reference_dtype = reference.dtype if reference is not None else None
    vocab = config.vocab_size
    stored_bytes = torch.finfo(checkpoint_dtype(config)).bits // 8
    checkpoint_bytes = (w.linears + w.embedding + (0 if w.tied else w.output)) * stored_bytes
    stages = {"load": BASE_BYTES}
    kept = 0.0  # what the job holds from one stage to the next
    window_logits = min(max_seq_len, 4096) * vocab * 4 * PREFILL_LOGITS
    text_tokens = (eval_tokens or _eval_tokens()) if reference_dtype is not None else []
    if reference_dtype is not None:
        ref_bytes = torch.finfo(reference_dtype).bits // 8
        weight_dtype = reference.weight_dtype
        eval_logits = sum(text_tokens) * vocab * 4
        ref_weights = w.linears * (torch.finfo(weight_dtype).bits // 8) + (w.embedding + (0 if w.tied else w.output)) * ref_bytes
        if weight_dtype != reference_dtype:
            ref_weights += w.per_layer * ref_bytes  # an fp32 scratch per weight shape of a decoder layer
        if reference.layer_major:
            ref_weights = w.largest_unit * ref_bytes  # one unit in memory at a time
        # the reference attends with aten SDPA: its bool causal mask [max_seq_len, max_seq_len] beside the caches
        stages["reference"] = (BASE_BYTES + ref_weights + _kv_cache_bytes(config, max_seq_len, ref_bytes)
                               + max_seq_len * max_seq_len + window_logits + eval_logits)
        kept += eval_logits
    per_recipe = []
    # a quantized module is kept while a later recipe shares it (recipes/pipeline/run.py releases it after its last)
    keys = [(r.quantization, r.export_options(max_seq_len, (options or {}).get(r.name)))
            if SCHEMES[r.quantization].quantize_exported is None else None for r in recipes]
    kept_modules: dict = {}
    for index, recipe in enumerate(recipes):
        scheme = SCHEMES[recipe.quantization]
        key = keys[index]
        recipe_options = (options or {}).get(recipe.name, {})
        lin_b, emb_b = scheme.module_bytes
        cache = _recipe_cache_bytes(config, recipe, max_seq_len, recipe_options)
        module = (w.linears + w.output) * lin_b + w.embedding * emb_b + cache
        pte_lin, pte_emb = recipe.pte_bytes or scheme.pte_bytes
        pte = (w.linears + w.output) * pte_lin + w.embedding * pte_emb
        before = BASE_BYTES + kept + sum(v for k, v in kept_modules.items() if k != key)
        needed_later = key is not None and key in keys[index + 1:]
        quantize = before + module + w.largest_unit * 4 * QUANTIZE_TRANSIENT
        if quantizes_by_unit(recipe.quantization, recipe_options):
            # the output layer is built right after the embedding (recipes/pipeline/prepare.py): its float matrix sits
            # beside the embedding alone, and the last decoder layer's beside the whole module
            quantize = before + max(w.embedding * emb_b + w.output * 4 * QUANTIZE_TRANSIENT,
                                    module + w.per_layer * 4 * QUANTIZE_TRANSIENT)
        if transforms_by_unit(recipe.quantization, recipe_options):
            # beside the module so far: one float decoder layer and the copies its transform's search holds
            copies = ALGORITHMS[recipe_algorithm(recipe.quantization, recipe_options)].unit_search_copies
            shape = module_shape(config)
            widest = shape.hidden * 2 * shape.intermediate
            quantize = max(quantize, before + module + (w.per_layer + copies * widest) * 4)
        if scheme.apply is not None and not quantizes_by_unit(recipe.quantization, recipe_options):
            built = w.linears + w.output + w.embedding  # the module's weights, the tied output layer its own copy
            float_module = built * torch.finfo(scheme.module_dtype).bits // 8
            quantize = before + module + float_module * (1 + WHOLE_MODEL_TRANSIENT)
            if recipe_options.get("mixed_precision_budget"):
                # quant/mixed_precision.py: an all-int4 and an all-8-bit copy, and fp32's calibration log-probs
                quantize += module + built + CALIBRATION_TOKENS * vocab * 4
        if scheme.quantize_exported is not None:  # PT2E: observers and the converted copy over the float module
            quantize = before + module * recipe.backend.pt2e_memory_ratio
        run = {
            "quantize": quantize,
            "export": before + module * (1 + _methods(recipe) * (STRICT_EXPORT_RATIO if recipe.backend.strict_export
                                                                  else EXPORT_RATIO)),
            "lower": before + module + _lowering_bytes(recipe, w, pte, pte_lin, recipe_options),
            # export-only lets go of the module once lowered (recipes/lowering/lower.py: release_lowered_weights)
            "serialize": (before + (module if reference_dtype is not None or needed_later else 0)
                          + pte * recipe.backend.serialize_memory_ratio),
        }
        if reference_dtype is not None:
            runs_here = recipe.backend.cannot_run_here() is None
            # the quantized module is released once lowered unless something runs it again; the program on the
            # runtime plans its own caches
            kept_module = module if (needed_later or module_runs_again(recipe, True, layer_map)) else 0
            run["generate"] = before + kept_module + ((pte * RUNTIME_RATIO + cache) if runs_here else 0) + window_logits
            # scored a window at a time (recipes/evaluation/fidelity.py: compare_step): the window's logits beside the
            # program's own output, and a few rows' float64 log-softmaxes
            run["fidelity"] = run["generate"] + window_logits
            if runs_here:
                ratio = PROFILE_RATIO_FLOAT if pte_lin >= 2 else PROFILE_RATIO_QUANTIZED
                run["profile"] = (before + (module if needed_later else 0) + pte * ratio + PROFILE_FIXED + cache
                                  + window_logits)
        if needed_later:
            kept_modules[key] = module
        else:
            kept_modules.pop(key, None)
        run = {k: int(v) for k, v in run.items()}
        per_recipe.append(RecipeEstimate(recipe=recipe.name, peak_rss_bytes=max(run.values()), stages=run,
                                         pte_bytes=int(pte)))
    stages = {k: int(v) for k, v in stages.items()}
    peak = max([*stages.values(), *(r.peak_rss_bytes for r in per_recipe)])
    return JobEstimate(
        peak_rss_bytes=int(peak), disk_bytes=sum(r.pte_bytes for r in per_recipe),
        checkpoint_bytes=int(checkpoint_bytes), reference_dtype=_dtype_name(reference_dtype), stages=stages,
        recipes=per_recipe,
        reference_weight_dtype=_dtype_name(reference.weight_dtype if reference is not None else None),
        eval_tokens=text_tokens or None, peak_stage=_peak_stage(stages, per_recipe),
        reference_layer_major=(reference is not None and reference.layer_major) or None)


def _peak_stage(stages: dict[str, int], per_recipe: list[RecipeEstimate]) -> str:
    """The stage of the job's peak: a shared stage's name, or a recipe's and its stage's."""
    stages = dict(stages)
    for r in per_recipe:
        stages.update({f"{r.recipe} {name}": value for name, value in r.stages.items()})
    return max(stages, key=stages.get)


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    """As report.json names a dtype, e.g. "bfloat16"."""
    return str(dtype).replace("torch.", "") if dtype else None


def reference_dtypes(estimate: JobEstimate | None) -> tuple[torch.dtype, torch.dtype | None]:
    """(the dtype the eager reference computes in, the one it keeps its matrices in) as the estimate chose them;
    fp32 and the checkpoint's own without an estimate."""
    if estimate is None:
        return torch.float32, None
    weight_dtype = estimate.reference_weight_dtype
    return getattr(torch, estimate.reference_dtype), getattr(torch, weight_dtype) if weight_dtype else None


def memory_budget() -> tuple[int, str]:
    """(bytes a job may use, where that figure comes from): the free RAM plus what this process already
    holds, or LOWERBENCH_MEMORY_LIMIT_GB when that is lower (a Space sets 16)."""
    import psutil

    free = psutil.virtual_memory().available + rss.rss_bytes()
    budget, where = free, f"{free / GB:.1f} GB free RAM"
    limit = os.environ.get(LIMIT_ENV)
    if limit:
        try:
            limit_bytes = float(limit) * GB
        except ValueError:
            raise UserFacingError(f"{LIMIT_ENV}={limit!r} is not a number; give the memory limit in GB, e.g. 16.") from None
        if limit_bytes < budget:
            budget, where = int(limit_bytes), f"the limit of {float(limit):g} GB ({LIMIT_ENV})"
    return int(budget), where


def check_job_fits(config, recipes: list, max_seq_len: int, generate: bool, options: dict | None = None,
                   eval_tokens: list[int] | None = None, layer_map: bool = False) -> JobEstimate:
    """The job's estimate, or a UserFacingError with its numbers and what would fit instead."""
    budget, where = memory_budget()
    estimate = estimate_job(config, recipes, max_seq_len, generate, budget, options, eval_tokens, layer_map)
    if estimate.peak_rss_bytes <= budget:
        return estimate
    choices = []
    if generate:
        export_only = estimate_job(config, recipes, max_seq_len, False, budget, options)
        choices.append(f"an export-only run (--export-only: {export_only.peak_rss_bytes / GB:.1f} GB)")
    if len(recipes) > 1:
        alone = {r.name: estimate_job(config, [r], max_seq_len, generate, budget, options, eval_tokens).peak_rss_bytes
                 for r in recipes}
        choices.append("one recipe at a time (" + ", ".join(f"{n}: {b / GB:.1f} GB" for n, b in alone.items()) + ")")

    lightest = {r.name: {"quant_algorithm": LIGHTEST_ALGORITHM} for r in recipes
                if LIGHTEST_ALGORITHM in SCHEMES[r.quantization].algorithms}
    if lightest:
        lighter = estimate_job(config, recipes, max_seq_len, generate, budget, lightest, eval_tokens)
        if lighter.peak_rss_bytes < estimate.peak_rss_bytes:
            choices.append(f"{LIGHTEST_ALGORITHM} qparams without a mixed-precision budget (--quant-algorithm "
                           f"{LIGHTEST_ALGORITHM}), which quantize piece by piece with no calibration search "
                           f"({lighter.peak_rss_bytes / GB:.1f} GB)")
    choices += _smaller_cache_choices(config, recipes, max_seq_len, generate, budget, options, eval_tokens,
                                      estimate.peak_rss_bytes)
    if max_seq_len > 256:
        shorter = estimate_job(config, recipes, 256, generate, budget, options, eval_tokens)
        choices.append(f"a smaller max context (--max-seq-len 256: {shorter.peak_rss_bytes / GB:.1f} GB)")
    raise UserFacingError(
        f"this job needs about {estimate.peak_rss_bytes / GB:.1f} GB of memory at its peak ({estimate.peak_stage}) "
        f"but {where} allows {budget / GB:.1f} GB; choose " + (", or ".join(choices) or "a smaller model") + "."
    )

# A ring the refusal offers: recent tokens a long context's chat keeps (the first few stay too).
SUGGESTED_WINDOW = 2048


def _smaller_cache_choices(config, recipes: list, max_seq_len: int, generate: bool, budget: int,
                           options: dict | None, eval_tokens, peak: int) -> list[str]:
    """For recipes that take the KV cache options (recipes/backends/xnnpack.py): an int8 cache, and a ring of
    recent tokens, each with the job's peak it would have, where that is lower."""
    takers = [r for r in recipes if "kv_cache" in r.backend.option_defaults(r)]
    choices = []
    for flag, change in (("--kv-cache int8", {"kv_cache": "int8"}),
                         (f"--kv-cache int8 --kv-cache-window {SUGGESTED_WINDOW}",
                          {"kv_cache": "int8", "kv_cache_window": SUGGESTED_WINDOW})):
        if not takers or ("kv_cache_window" in change and max_seq_len <= SUGGESTED_WINDOW):
            continue
        changed = {r.name: {**(options or {}).get(r.name, {}), **(change if r in takers else {})} for r in recipes}
        lighter = estimate_job(config, recipes, max_seq_len, generate, budget, changed, eval_tokens).peak_rss_bytes
        if lighter < peak:
            choices.append(f"smaller KV caches ({flag}: {lighter / GB:.1f} GB)")
    return choices
