"""What a job is asked to do (RunRequest), the checks that refuse it before any export, and each recipe's options
resolved from its defaults and the request's."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from models.sources.checkpoint import Checkpoint
from models.errors import UserFacingError
from models.families import module_shape
from models.module_options import ATTENTION_SINK_TOKENS
from models.prompting import prompt_token_ids
from quant.calibration_file import CalibrationFile, read_calibration_file
from quant.quantize import calibration_tokens_read, check_options
from quant.schemes import check_group_size, check_group_size_fits, scheme_options
from recipes.running.generate import DEFAULT_PROMPT
from recipes.registry import Recipe, load_backends

# Options every quantizing recipe may take (the CLI's --group-size, --quant-algorithm, --mixed-precision-budget).
SHARED_OPTIONS = ("group_size", "quant_algorithm", "mixed_precision_budget")


@dataclass
class RunRequest:
    recipes: list[str]
    out_dir: Path
    model: str | None = None
    revision: str | None = None
    token: str | None = field(default=None, repr=False)
    allow_pickle: bool = False
    prompt: str = DEFAULT_PROMPT
    max_new_tokens: int = 32
    max_seq_len: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    options: dict = field(default_factory=dict)  # recipe options: group_size, ...
    # False: only the .pte and its delegation report (CI jobs that test the .pte elsewhere); no sample
    # generations and no fidelity, so the report's generations list is empty.
    generate: bool = True
    # An event-traced second pass of the generation, after the timed one (recipes/running/profile.py).
    profile: bool = True
    # ExecuTorch's ETRecord beside model.pte (its devtools map a profile back to the graph); it holds the
    # exported and edge programs with their weights, a few times the .pte, so it is asked for.
    etrecord: bool = False
    # fidelity.layers: each decoder layer's error against fp32; where the .pte runs here it costs a second
    # export and lowering (with the layer outputs tapped), so it is asked for.
    layer_map: bool = False
    # The delegates' weights in model.ptd beside model.pte (ExecuTorch's data file) where the backend can write
    # one: True always, False never, None above a size (recipes/pipeline/run.py: writes_data_file).
    weights_file: bool | None = None
    # The user's calibration text (UTF-8, or .jsonl chats: quant/calibration_file.py) in place of the built-in
    # one, for the recipes that read calibration; the fidelity texts stay the same, so recipes still compare.
    calibration_file: Path | None = None
    # A PEFT LoRA adapter (a local folder or a Hub repo id, at adapter_revision) merged into the weights before
    # quantization (models/sources/adapter.py).
    adapter: str | None = None
    adapter_revision: str | None = None


def user_options(group_size=None, quant_algorithm=None, mixed_precision_budget=None, kv_cache=None,
                 kv_cache_window=None) -> dict:
    """The recipe options a user set, from the CLI's flags or the app's Advanced controls. Unset ones (None, 0,
    "") are left out, so each recipe keeps its own defaults."""
    given = {"group_size": int(group_size) if group_size else None, "quant_algorithm": quant_algorithm or None,
             "mixed_precision_budget": None if mixed_precision_budget is None else float(mixed_precision_budget),
             "kv_cache": kv_cache or None, "kv_cache_window": int(kv_cache_window) if kv_cache_window else None}
    return {key: value for key, value in given.items() if value is not None}


def recipe_option_pairs(pairs: list[str]) -> dict:
    """`KEY=VALUE` strings (the CLI's --option) as recipe options; whole numbers become ints."""
    options = {}
    for pair in pairs:
        key, eq, value = (part.strip() for part in pair.partition("="))
        if not eq or not key or not value:
            raise UserFacingError(f"recipe option {pair!r} is not KEY=VALUE; write e.g. --option layers_per_shard=2.")
        options[key] = int(value) if value.isdigit() else value
    return options


def recipe_defaults(recipe: Recipe) -> dict:
    return {**scheme_options(recipe.quantization), **recipe.backend.option_defaults(recipe), **recipe.options}


def recipe_options(recipe: Recipe, requested: dict) -> dict:
    """The recipe's options: its defaults, overridden by the requested options it takes."""
    defaults = recipe_defaults(recipe)
    return {**defaults, **{k: v for k, v in requested.items() if k in defaults}}


def preparation_key(recipe: Recipe, options: dict, max_seq_len: int) -> tuple:
    """What makes two recipes' quantized modules the same, given each recipe's options. Source transforms depend
    on the group size only, so backends that differ in other options (SoC, compute units) still share one
    quantization. PT2E quantizers depend on every option: their modules are never shared."""
    return (recipe.quantization, options.get("group_size"), options.get("quant_algorithm"),
            options.get("mixed_precision_budget"), recipe.export_options(max_seq_len, options), recipe.static_io,
            options.get("max_linear_outputs"))


def validate_request(request: RunRequest, recipes: list[Recipe]) -> None:
    if not request.recipes:
        raise UserFacingError("no recipe chosen; pick at least one (see `python -m recipes list`).")
    if len(set(request.recipes)) != len(request.recipes):
        raise UserFacingError("a recipe is named twice; name each recipe once.")
    if request.max_seq_len < 16:
        raise UserFacingError(f"max context must be at least 16 tokens, got {request.max_seq_len}.")
    if request.max_new_tokens < 1:
        raise UserFacingError(f"max new tokens must be at least 1, got {request.max_new_tokens}.")
    if request.max_new_tokens >= request.max_seq_len:
        raise UserFacingError(
            f"max new tokens ({request.max_new_tokens}) must be smaller than max context ({request.max_seq_len})."
        )
    if not request.prompt.strip():
        raise UserFacingError("the prompt is empty; type a prompt.")
    if request.adapter_revision and not request.adapter:
        raise UserFacingError("an adapter revision is given without an adapter; name the adapter (--adapter) or "
                              "leave the revision out.")
    # The app sends every backend's options with every job; each recipe takes those it has. A name no recipe
    # takes is a mistake (a typo would otherwise be dropped silently).
    known = {key for recipe in load_backends().recipes.values() for key in recipe_defaults(recipe)}
    unknown = sorted(set(request.options) - known - set(SHARED_OPTIONS))
    if unknown:
        raise UserFacingError(f"{', '.join(unknown)}: no recipe takes this option; the recipes' options: "
                              f"{', '.join(sorted(known))} (`python -m recipes list` shows which recipe takes which).")
    for recipe in recipes:
        check_recipe_options(recipe, recipe_options(recipe, request.options))


def check_recipe_options(recipe: Recipe, options: dict) -> None:
    """Refuses, before anything is loaded, what the recipe's options (resolved: recipe_options) cannot be: a group
    size or algorithm its scheme does not take, a value its backend does not."""
    check_group_size(recipe.quantization, options.get("group_size"))
    check_options(recipe.quantization, options)
    recipe.backend.check_options(options)


def check_limits(config, recipes: list[Recipe], max_seq_len: int, options: dict) -> None:
    """Refuses, from the config alone (before any weight is read or downloaded), a context beyond the model's, a
    KV ring that could never wrap within it, and a group size the model's widths do not divide. options: recipe
    name -> its options."""
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if limit and max_seq_len > limit:
        raise UserFacingError(
            f"max context {max_seq_len} is beyond this model's limit of {limit} tokens "
            f"(max_position_embeddings); choose at most {limit}, or keep a ring of recent tokens "
            f"(--kv-cache-window) to generate past the context."
        )
    shape = module_shape(config)
    if max_seq_len > shape.max_position_embeddings:
        raise UserFacingError(
            f"max context {max_seq_len} is beyond the {shape.max_position_embeddings} tokens this model's rotary "
            f"embedding computes with one table (original_max_position_embeddings); choose at most "
            f"{shape.max_position_embeddings}, or keep a ring of recent tokens (--kv-cache-window)."
        )
    if shape.sliding_window is not None and max_seq_len > shape.sliding_window:
        raise UserFacingError(
            f"max context {max_seq_len} is beyond this model's sliding attention window of {shape.sliding_window} "
            f"tokens, which Lowerbench does not compute; choose at most {shape.sliding_window}, or keep a ring of "
            f"recent tokens (--kv-cache-window)."
        )
    for name, recipe_options in options.items():
        window = recipe_options.get("kv_cache_window")
        if window and limit and window + ATTENTION_SINK_TOKENS >= limit:
            raise UserFacingError(
                f"a KV cache window of {window} tokens ({name}) keeps, with its {ATTENTION_SINK_TOKENS} attention "
                f"sinks, the model's whole context of {limit} tokens (max_position_embeddings): the ring never "
                f"wraps, and its cache is larger than a plain one. Choose a window below "
                f"{limit - ATTENTION_SINK_TOKENS}, or none (--max-seq-len {limit} holds the whole context)."
            )
    for recipe in recipes:
        check_group_size_fits(recipe.quantization, options[recipe.name].get("group_size"), config)


def check_prompt_fits(checkpoint: Checkpoint, request: RunRequest) -> None:
    """Refuses, before any export, a prompt that does not fit in the context when the job generates (an
    export-only job has no prompt to fit)."""
    if not request.generate:
        return
    prompt_tokens = len(prompt_token_ids(checkpoint.tokenizer, request.prompt))
    if prompt_tokens + request.max_new_tokens > request.max_seq_len:
        raise UserFacingError(
            f"the prompt is {prompt_tokens} tokens; with {request.max_new_tokens} new tokens it does not fit in the "
            f"max context of {request.max_seq_len}; shorten the prompt, lower max new tokens or raise max context."
        )


def read_request_calibration(request: RunRequest, recipes: list[Recipe], options: dict) -> CalibrationFile | None:
    """The request's calibration file read and checked (None without one), before anything is loaded: refused
    when it is unreadable, not text, malformed, or when none of the recipes reads calibration. options: recipe
    name -> its options."""
    if request.calibration_file is None:
        return None
    file = read_calibration_file(request.calibration_file)
    if not calibration_readers(recipes, options):
        raise UserFacingError(
            f"no chosen recipe reads a calibration text ({', '.join(r.name for r in recipes)}); a calibration file "
            "is read by AWQ and GPTQ (--quant-algorithm), the mixed-precision search and the PT2E (QNN) recipes. "
            "Choose one of those, or leave the calibration file out."
        )
    return file


def calibration_readers(recipes: list[Recipe], options: dict) -> dict[str, int]:
    """Recipe name -> the calibration tokens it reads, for the recipes that read any."""
    read = {recipe.name: calibration_tokens_read(recipe.quantization, options[recipe.name]) for recipe in recipes}
    return {name: tokens for name, tokens in read.items() if tokens is not None}


def tokenized_calibration(file: CalibrationFile | None, tokenizer, recipes: list[Recipe],
                          options: dict) -> CalibrationFile | None:
    """The calibration file's tokens by the model's tokenizer, refused (before any quantization) when they are
    fewer than a recipe's algorithm reads."""
    if file is None:
        return None
    file = file.tokenized(tokenizer)
    short = {name: tokens for name, tokens in calibration_readers(recipes, options).items() if len(file.ids) < tokens}
    if short:
        needed = ", ".join(f"{name}: {tokens}" for name, tokens in short.items())
        raise UserFacingError(
            f"calibration file {file.name!r} is {len(file.ids)} tokens by this model's tokenizer, fewer than its "
            f"recipes read ({needed}); give a longer text, or leave the file out to use the built-in one."
        )
    return file
