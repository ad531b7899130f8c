"""report.json as dataclasses, one per section, and the job's summary that the CLI, the app and the zoo read.

The pipeline fills these; `Report.to_dict()` is the one serialization of a report (run writes it once per recipe)
and `Report.from_dict()` / `load_report()` read one back. Reading is lenient, so that files written by earlier
versions load: a key the file lacks takes its field's default, a key this version does not know is skipped.
Sections converted from another module's plain data with strict=True refuse keys they do not know instead, so a
new key there cannot silently go missing from report.json. A figure with `digits` is written rounded to them; a field
marked `elsewhere` is no key of its section (the job's estimate carries each recipe's time, which that recipe's
report writes under timings_s.estimate).

Torch-free on purpose: app.py imports it before thread_policy.limit_openmp_default() has run, and a job's summary
comes back to the app pickled from the job's own process."""
from __future__ import annotations

import importlib.metadata
import json
import platform
import traceback
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable

from models.errors import UserFacingError

# The packages every report names; the backends add their own (recipes/registry.py: backend_packages).
CORE_PACKAGES = ("torch", "executorch", "torchao", "transformers")


def optional(load: Callable | None = None, key: str | None = None, digits: int | None = None):
    """A key report.json leaves out when it has no value."""
    return field(default=None, metadata={"omit_none": True, "load": load, "key": key, "digits": digits})


def rounded(digits: int):
    """A figure kept as computed and written rounded to `digits`."""
    return field(default=None, metadata={"digits": digits})


def elsewhere(default_factory: Callable | None = None):
    """A field that is no key of its section: report.json writes it in another section, or not at all. It takes no
    part in comparing sections, so a report read back equals the one written."""
    if default_factory is None:
        return field(default=None, compare=False, metadata={"elsewhere": True})
    return field(default_factory=default_factory, compare=False, metadata={"elsewhere": True})


def section(load: Callable, key: str | None = None, many: bool = False):
    """A nested section (or, with many, a list of them), read back with `load`."""
    if many:
        return field(default_factory=list, metadata={"load": load, "many": True, "key": key})
    return field(default=None, metadata={"load": load, "key": key})


def _plain(value):
    if isinstance(value, Section):
        return value.to_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _key(f) -> str:
    return f.metadata.get("key") or f.name


def _keyed_fields(section) -> list:
    """The fields that are keys of the section, in order."""
    return [f for f in fields(section) if not f.metadata.get("elsewhere")]


def _written(f, value):
    digits = f.metadata.get("digits")
    return value if digits is None or value is None else round(value, digits)


class Section:
    """A part of report.json: its keys are its fields, in field order (a field's `key` metadata names a key
    that differs from it); a field marked `spread` holds keys this version does not name, kept as they are."""

    def to_dict(self) -> dict:
        data = {}
        for f in _keyed_fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("spread"):
                data.update(_plain(value))
            elif value is not None or not f.metadata.get("omit_none"):
                data[_key(f)] = _plain(_written(f, value))
        return data

    def as_written(self):
        """A copy whose figures are as report.json writes them (rounded to their fields' digits)."""
        return replace(self, **{f.name: _written(f, getattr(self, f.name)) for f in _keyed_fields(self)
                                if f.metadata.get("digits") is not None})

    @classmethod
    def from_dict(cls, data: dict | None, strict: bool = False):
        if data is None:
            return None
        values, known = {}, set()
        spread = next((f for f in fields(cls) if f.metadata.get("spread")), None)
        for f in _keyed_fields(cls):
            known.add(_key(f))
            if _key(f) not in data:
                if f.default is MISSING and f.default_factory is MISSING:
                    values[f.name] = None  # a field the code always fills, missing from an older file
                continue
            value, load = data[_key(f)], f.metadata.get("load")
            if load is not None and value is not None:
                value = [load(item, strict) for item in value] if f.metadata.get("many") else load(value, strict)
            values[f.name] = value
        unknown = {key: value for key, value in data.items() if key not in known}
        if spread is not None:
            values[spread.name] = unknown
        elif unknown and strict:
            raise ValueError(f"{cls.__name__} has no field for {', '.join(sorted(unknown))}; add it to "
                             "recipes/output/report.py so that report.json keeps it")
        return cls(**values)


def _loader(cls) -> Callable:
    return lambda data, strict: cls.from_dict(data, strict)


@dataclass
class AdapterInfo(Section):
    """model.adapter: the PEFT LoRA adapter merged into the checkpoint's weights before quantization
    (models/sources/adapter.py: LoraAdapter.describe)."""
    source: str | None = None  # hub or local-folder
    id: str | None = None  # the Hub repo id, or the folder's name
    revision: str | None = None  # None for a local folder
    r: int | None = None
    alpha: float | None = None
    target_modules: list[str] = field(default_factory=list)  # the kinds of linear it changes
    linears: int | None = None  # the linears it changed, over every layer
    rslora: bool | None = optional()  # scaled by alpha / sqrt(r) rather than alpha / r
    rank_pattern: dict | None = optional()  # per-module ranks and alphas where they differ from r and alpha
    alpha_pattern: dict | None = optional()


@dataclass
class ModelInfo(Section):
    """model: the checkpoint (models/sources/checkpoint.py: Checkpoint.describe)."""
    source: str | None = None  # builtin, hub, local-folder, gguf
    id: str | None = None
    revision: str | None = None
    architecture: str | None = None
    family: str | None = optional()  # models/families/ name; a report of an older version has none
    parameters: int | None = None
    adapter: AdapterInfo | None = optional(_loader(AdapterInfo))  # a job without one writes no key


@dataclass
class KvCache(Section):
    """recipe.kv_cache: how the program keeps its K/V caches, for a recipe that takes the KV cache options
    (models/llama.py: ExportOptions)."""
    dtype: str | None = None  # fp32, fp16, or int8 (per token and head, with an fp32 scale and an int8 zero point)
    window: int | None = None  # the ring's recent tokens; None: every token attends to the whole context
    sink_tokens: int | None = None  # the first tokens a ring keeps for good
    rows: int | None = None  # cache rows per layer
    bytes: int | None = None  # every layer's k and v caches, int8's scales and zero points included
    tokens_per_call: int | None = None  # the most tokens one call takes; a longer prompt goes in several calls


@dataclass
class RecipeInfo(Section):
    """recipe: what ran, with the options it ran with (the recipe's own, the request's, and what the backend
    says about its compile target, e.g. a SoC's architecture)."""
    name: str | None = None
    backend: str | None = None
    quantization: str | None = None
    options: dict = field(default_factory=dict)
    max_seq_len: int | None = None
    runs_on: str | None = None
    kv_cache: KvCache | None = optional(_loader(KvCache))


@dataclass
class Threads(Section):
    """threads: the thread setup the figures were measured under (recipes/process/thread_policy.py: describe)."""
    openmp_default: str | None = None
    openmp_default_set_by: str | None = None
    torch_intra_op: int | None = None
    torch_during_runtime_calls: int | None = None
    cores_share: int | None = optional()  # LOWERBENCH_CORES, when the process was given a share of the cores


@dataclass
class Pt2eCalibration(Section):
    """timings_s.calibration: what a PT2E scheme's observers saw."""
    prompts: int | None = None
    source: str | None = None


@dataclass
class TimeEstimate(Section):
    """timings_s.estimate: the recipe's seconds as estimated before the job from the zoo's measured cells
    (recipes/estimates/time_estimate.py): exporting, lowering (and serializing) and the rest (quantizing; in a full job also
    generating and scoring), and in total with the job's shared stages (loading, the reference), as
    timings_s.total counts them."""
    export: float | None = rounded(1)
    lower: float | None = rounded(1)
    other: float | None = rounded(1)
    total: float | None = rounded(1)
    fitted_on: str | None = None  # the parameter range of the cells behind it, e.g. "134M–3.2B"
    shared: float | None = optional(digits=1)  # the job's shared stages, within total
    rates_from: str | None = optional()  # the CPUs, cores and dates of the cells behind it
    host_speed: float | None = optional(digits=2)  # this host's Python speed against those cells', > 1: faster


@dataclass
class Timings(Section):
    """timings_s: seconds per stage (a stage that did not run has no key), and the job's peak RSS."""
    load: float | None = optional()
    reference_generation: float | None = optional()
    reference_fidelity: float | None = optional()
    shared_quantization_with: str | None = optional()  # the recipe whose quantized module this one reused
    quantize: float | None = optional()
    # the parts of quantize (quant/quantize.py)
    quant_algorithm: float | None = optional()
    mixed_precision_search: float | None = optional()
    quantize_transform: float | None = optional()
    export: float | None = optional()
    calibration: Pt2eCalibration | None = optional(load=_loader(Pt2eCalibration))
    lower: float | None = optional()
    serialize: float | None = optional()
    generate: float | None = optional()
    fidelity: float | None = optional()
    layer_map: float | None = optional()
    runner_generate: float | None = optional()
    profile: float | None = optional()
    peak_rss_mb: float | None = optional()
    total: float | None = optional()  # the recipe's wall: the job's shared stages (loading, reference) and its own
    estimate: TimeEstimate | None = optional(load=_loader(TimeEstimate))
    other: dict = field(default_factory=dict, metadata={"spread": True})  # seconds of parts not named above

    def add(self, stage: str, seconds: float) -> None:
        """Adds to a stage's seconds (a stage may run more than once, e.g. quantize for PT2E)."""
        setattr(self, stage, round((getattr(self, stage) or 0.0) + seconds, 3))

    def add_parts(self, seconds: dict[str, float]) -> None:
        """The seconds of a stage's parts, as quant/ reports them."""
        names = {f.name for f in fields(self)} - {"other"}
        for part, value in seconds.items():
            if part in names:
                setattr(self, part, value)
            else:
                self.other[part] = value


@dataclass
class Pte(Section):
    """pte: the program written beside the report, and the data file with its weights when it has one."""
    path: str | None = None
    bytes: int | None = None
    sha256: str | None = None
    ptd_path: str | None = optional()
    ptd_bytes: int | None = optional()
    ptd_sha256: str | None = optional()


@dataclass
class LlmMetadata(Section):
    """llm_metadata: the constant methods ExecuTorch's LLM runners read from the .pte (recipes/lowering/llm_metadata.py)."""
    get_max_seq_len: int | None = None
    get_max_context_len: int | None = None
    get_vocab_size: int | None = None
    get_n_layers: int | None = None
    use_kv_cache: bool | None = None
    use_sdpa_with_kv_cache: bool | None = None
    enable_dynamic_shape: bool | None = None
    get_bos_id: int | None = optional()
    get_eos_ids: list[int] | None = optional()
    # A static-shape program's, those of ExecuTorch's static Llama export (recipes/lowering/static_program.py; its
    # tensors, the rope tables and the inputs' indices, stay in the .pte): tokens per decode and prefill call, and
    # the caches' widths.
    vocab_size: int | None = optional()
    head_dim: int | None = optional()
    n_heads_per_cache: int | None = optional()
    decode_input_len: int | None = optional()
    prefill_input_len: int | None = optional()
    # A KV-I/O program's, those of Qualcomm's static Llama export (recipes/lowering/kv_io_program.py): tokens per
    # decode call, the model's widths, and the bits of the K/V inputs and outputs (32: float).
    get_ar_len: int | None = optional()
    get_eos_id: int | None = optional()
    get_dim: int | None = optional()
    get_head_dim: int | None = optional()
    get_max_batch_size: int | None = optional()
    get_n_bos: int | None = optional()
    get_n_eos: int | None = optional()
    get_n_kv_heads: int | None = optional()
    get_use_kv_cache: bool | None = optional()
    get_kv_io_bit_width: int | None = optional()


@dataclass
class DelegatedOp(Section):
    """delegation.ops[]: one edge op type, its nodes inside and outside the backend's partitions."""
    op: str | None = None  # the edge op, e.g. aten_linear_default
    delegated: int | None = None
    non_delegated: int | None = None
    before_partitioning: int | None = None  # its nodes in the edge graph before partitioning; None: not recorded
    # for an op left outside: the partitioners' log records naming it, [{source, reason}]
    why_not_delegated: list[dict] = field(default_factory=list)


@dataclass
class Delegation(Section):
    """delegation: how much of the lowered graph its backend took (recipes/lowering/delegation.py)."""
    delegated_subgraphs: int | None = None
    delegated_nodes: int | None = None
    non_delegated_nodes: int | None = None
    delegated_percent: float | None = None
    ops: list[DelegatedOp] = section(_loader(DelegatedOp), many=True)  # the ops left outside first
    engine: str | None = None
    edge_nodes_before_partitioning: int | None = None
    preserved_ops: dict[str, list[str]] = field(default_factory=dict)  # partitioner -> ops kept from decomposition
    why_not_delegated_source: str | None = None
    # A program of several methods (a static recipe's prefill and decode): their names; the counts are their sums.
    methods: list[str] | None = optional()


@dataclass
class Generation(Section):
    """generations[]: one engine's answer to the prompt (recipes/running/generate.py)."""
    engine: str
    prompt: str
    text: str
    prompt_tokens: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    tokens: list[int] = field(default_factory=list)  # the new token ids, stop token included
    # the dtype the engine keeps its weights in, when it computes in another (models/compute_dtype.py)
    weights_dtype: str | None = None


@dataclass
class RunnerGeneration(Generation):
    """A generation by ExecuTorch's LLM runner, with the runner's own statistics (recipes/running/llm_runner.py)."""
    model_load_ms: int | None = None
    time_to_first_token_ms: int | None = None
    pieces: list[str] = field(default_factory=list)  # the text of each new token, as the runner emitted it
    prompt_note: str | None = None  # set when the runner's prompt tokens differ in number from the step loop's


def _generation(data: dict, strict: bool) -> Generation:
    return (RunnerGeneration if "model_load_ms" in data else Generation).from_dict(data, strict)


@dataclass
class QuantCalibration(Section):
    """quantization.calibration: the text a calibrated algorithm read (quant/calibration.py): the built-in one, or
    the user's calibration file (quant/calibration_file.py)."""
    text: str | None = None
    tokens: int | None = None
    search_tokens: int | None = optional()  # what AWQ's and the mixed-precision search read, when fewer
    # the dtype AWQ's search multiplied its candidates in: bf16 where the CPU has bf16 instructions, else fp32
    search_products: str | None = optional()
    file: str | None = optional()  # the calibration file's name, never its path
    file_tokens: int | None = optional()  # all of its tokens by the model's tokenizer (tokens: those read)
    file_sha256: str | None = optional()  # of its bytes


@dataclass
class MixedPrecision(Section):
    """quantization.mixed_precision: the linears the search kept at 8 bits (quant/mixed_precision.py)."""
    budget_fraction: float | None = None
    units_8bit: list[str] = field(default_factory=list)
    extra_bytes_per_token: int | None = None
    int4_bytes_per_token: int | None = None
    measured_on: str | None = None
    measured_on_tokens: int | None = None
    int4_mean_kl: float | None = None
    unit_kl_gain: dict[str, float] = field(default_factory=dict)
    unit_cost_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class Quantization(Section):
    """quantization: the scheme and algorithm the recipe's module was quantized with (quant/quantize.py)."""
    scheme: str | None = None
    algorithm: str | None = None  # the int4 algorithm; None for a scheme without int4 weights
    calibration: QuantCalibration | None = optional(load=_loader(QuantCalibration))
    mixed_precision: MixedPrecision | None = optional(load=_loader(MixedPrecision))
    weight_bytes_per_token: int | None = optional()  # None for a PT2E scheme, quantized after export


@dataclass
class StageError(Section):
    """errors[]: a stage that failed, and why."""
    stage: str | None = None
    message: str | None = None
    traceback: str | None = optional()  # for failures that are not the user's to fix

    @classmethod
    def of(cls, stage: str, err: Exception) -> StageError:
        """Called in the except block: an unexpected error keeps its traceback."""
        if isinstance(err, UserFacingError):
            return cls(stage, str(err))
        return cls(stage, f"{type(err).__name__}: {err}", traceback.format_exc(limit=8))


@dataclass
class Heldout(Section):
    """fidelity.heldout: the same figures on a second text no algorithm was tuned on (recipes/evaluation/fidelity.py);
    fidelity.calibration_heldout: on the held-out end of the user's calibration file, when it is long enough."""
    text: str | None = None
    positions: int | None = None
    perplexity_fp32: float | None = None
    perplexity: float | None = None
    perplexity_ratio: float | None = None
    top1_agreement_percent: float | None = None
    mean_kl: float | None = None


@dataclass
class LayerError(Section):
    """fidelity.layers.layers[]: one decoder layer's output against the reference's (quant/layer_error.py)."""
    layer: int | None = None
    sqnr_db: float | None = None  # None where the outputs are equal (an infinite SQNR)
    relative_error: float | None = None


@dataclass
class LayerMap(Section):
    """fidelity.layers: each decoder layer's error against the reference (recipes/evaluation/layer_map.py), or the error
    that stopped the map, alone under `error`."""
    engine: str | None = None
    method: str | None = None
    layers: list[LayerError] = section(_loader(LayerError), many=True)
    error: StageError | None = optional(load=_loader(StageError))

    def to_dict(self) -> dict:
        return {"error": self.error.to_dict()} if self.error is not None else super().to_dict()


@dataclass
class Fidelity(Section):
    """fidelity: how far the recipe's model is from the reference (recipes/evaluation/fidelity.py), or the error that
    stopped the measurement, alone under `error`."""
    engine: str | None = None
    text: str | None = None
    positions: int | None = None
    perplexity_fp32: float | None = None
    perplexity: float | None = None
    perplexity_ratio: float | None = None
    top1_agreement_percent: float | None = None
    mean_kl: float | None = None
    target: str | None = None
    meets_target: bool | None = None  # None for a scheme without a target
    heldout: Heldout | None = section(_loader(Heldout))
    reference_engine: str | None = None
    layers: LayerMap | None = section(_loader(LayerMap))  # None when no map was asked for
    calibration_heldout: Heldout | None = optional(load=_loader(Heldout))  # with a long enough calibration file
    error: StageError | None = optional(load=_loader(StageError))

    def to_dict(self) -> dict:
        return {"error": self.error.to_dict()} if self.error is not None else super().to_dict()


@dataclass
class OpRow(Section):
    """profile.<phase>.ops[]: one op's share of a step."""
    op: str | None = None  # a kernel's operator (aten::embedding.out), a delegate's own event (Fully Connected ...)
    delegated: bool | None = None
    backend: str | None = None  # the delegate's backend id, e.g. XnnpackBackend
    count: int | None = None  # instances in one step
    ms_per_step: float | None = None  # mean over steps of the instances' summed time
    p50_ms_per_step: float | None = None
    percent_of_step: float | None = None


@dataclass
class PhaseProfile(Section):
    """profile.prefill / profile.decode."""
    steps: int | None = None
    step_ms: float | None = None  # Method::execute, mean over steps
    step_p50_ms: float | None = None
    measured_step_ms: float | None = None  # wall time of the same calls from Python, tracer on, mean over steps
    measured_p50_ms: float | None = None
    outside_delegates_percent: float | None = None
    ops: list[OpRow] = section(_loader(OpRow), many=True)


@dataclass
class ProfileLoad(Section):
    """profile.load: the program's load (wall), load_method and method init (ETDump), and the warm-up call."""
    program_load_ms: float | None = None
    load_method_ms: float | None = None
    method_init_ms: float | None = None
    first_call_ms: float | None = None


@dataclass
class ProfileFiles(Section):
    """profile.files: what sits beside model.pte."""
    etdump: str | None = None
    prefill_etdump: str | None = None
    etrecord: str | None = None  # None unless an ETRecord was asked for


@dataclass
class Profile(Section):
    """profile: where the .pte's time goes on the ExecuTorch runtime (recipes/running/profile.py)."""
    engine: str | None = None
    executorch: str | None = None
    load: ProfileLoad | None = section(_loader(ProfileLoad))
    prefill: PhaseProfile | None = section(_loader(PhaseProfile))
    decode: PhaseProfile | None = section(_loader(PhaseProfile))  # None when the generation stopped at once
    files: ProfileFiles | None = section(_loader(ProfileFiles))


@dataclass
class RecipeEstimate(Section):
    """memory.estimate.recipes[]: one recipe's share of the job's estimate."""
    recipe: str | None = None
    peak_rss_bytes: int | None = None
    stages: dict[str, int] = field(default_factory=dict)  # stage -> peak RSS of the process during it
    pte_bytes: int | None = None  # its .pte (and .ptd)
    # its seconds on this host, which its own report writes under timings_s.estimate; None where the zoo has no
    # cell to time it from
    time: TimeEstimate | None = elsewhere()


@dataclass
class JobEstimate(Section):
    """memory.estimate: the job's estimate, made from the model's config before any weight was read
    (recipes/estimates/): memory per stage and recipe, disk, and each recipe's time. The app shows it before the
    job, the zoo refuses a cell by it, and each recipe's report keeps it."""
    peak_rss_bytes: int | None = None
    disk_bytes: int | None = None  # the outputs (.pte files); a download is checked on its own by models/sources/hub.py
    checkpoint_bytes: int | None = None  # the weights as stored (bf16 for most Hub checkpoints)
    reference_dtype: str | None = None  # the eager reference's dtype, e.g. "float32"; None without generation
    stages: dict[str, int] = field(default_factory=dict)  # stages before any recipe (load, reference)
    recipes: list[RecipeEstimate] = section(_loader(RecipeEstimate), many=True)
    # the dtype the reference keeps its matrices in (models/compute_dtype.py); None without generation
    reference_weight_dtype: str | None = None
    eval_tokens: list[int] | None = None  # the fidelity texts' token counts it assumed; None without generation
    peak_stage: str | None = None  # e.g. "xnnpack-8da4w lower", or a shared stage
    # Neither whole reference fits: the fp32 reference scores the texts one unit at a time from the checkpoint
    # (recipes/evaluation/layer_major_reference.py) and makes no generation.
    reference_layer_major: bool | None = optional()
    time_notes: list[str] = elsewhere(list)  # where the time estimate leaves what the zoo's cells measured

    def recipe_row(self, name: str) -> RecipeEstimate | None:
        return next((row for row in self.recipes if row.recipe == name), None)

    def recipe_time(self, name: str) -> TimeEstimate | None:
        """The recipe's timings_s.estimate, as its report.json keeps it."""
        row = self.recipe_row(name)
        return row.time.as_written() if row is not None and row.time is not None else None

    @property
    def seconds(self) -> float | None:
        """The whole job's: its shared stages once, then each recipe's own; None without a time estimate."""
        times = [row.time for row in self.recipes]
        if not times or any(time is None for time in times):
            return None
        return times[0].total + sum(time.total - time.shared for time in times[1:])


@dataclass
class Memory(Section):
    """memory: the peak RSS of each stage (recipes/process/rss.py), the job's peak, and the estimate."""
    peak_rss_mb_by_stage: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float | None = None
    estimate: JobEstimate | None = section(_loader(JobEstimate))


@dataclass
class Report(Section):
    """A recipe's report.json."""
    model: ModelInfo | None = section(_loader(ModelInfo))
    recipe: RecipeInfo | None = section(_loader(RecipeInfo))
    versions: dict[str, str | None] = field(default_factory=dict)  # package -> version, and python
    threads: Threads | None = section(_loader(Threads))
    timings: Timings = field(default_factory=Timings, metadata={"load": _loader(Timings), "key": "timings_s"})
    pte: Pte | None = section(_loader(Pte))  # None when the recipe failed
    llm_metadata: LlmMetadata | None = section(_loader(LlmMetadata))
    delegation: Delegation | None = section(_loader(Delegation))
    # the reference's first, then the recipe's: the LLM runner's before the step loop's
    generations: list[Generation] = section(_generation, many=True)
    quantization: Quantization | None = section(_loader(Quantization))
    fidelity: Fidelity | None = section(_loader(Fidelity))
    errors: list[StageError] = section(_loader(StageError), many=True)
    generation_note: str | None = optional()  # why there are no generations
    runtime_note: str | None = optional()  # why the .pte did not run here (the recipe's generation is eager)
    runner_note: str | None = optional()  # why ExecuTorch's LLM runner gave no generation
    profile: Profile | None = section(_loader(Profile))
    profile_note: str | None = optional()  # why there is no profile
    memory: Memory | None = section(_loader(Memory))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def load_report(path: str | Path) -> Report:
    """A report.json, or the report.json of a recipe folder."""
    path = Path(path)
    return Report.from_dict(json.loads((path / "report.json" if path.is_dir() else path).read_text()))


def package_versions(packages: Iterable[str] = ()) -> dict[str, str | None]:
    """report.versions: the core packages' versions, then `packages`' (None when not installed), then Python's."""
    found: dict[str, str | None] = {}
    for name in dict.fromkeys((*CORE_PACKAGES, *packages)):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    return found


@dataclass
class JobSummary:
    """What run() returns: the model, the reference's generation (None for an export-only job) and each recipe's
    report, in the order asked; each report is also on disk."""
    model: ModelInfo
    reference: Generation | None
    recipes: list[Report]
