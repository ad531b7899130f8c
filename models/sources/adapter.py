"""A PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors) from a local folder or the Hub, read
and checked before anything heavy runs: its type and options, the base model it names, the modules it targets and
the shapes of its A and B matrices against the checkpoint's config. Each refusal is one UserFacingError saying what
to do. Merging it into the weights: models/sources/adapter_merge.py."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.errors import UserFacingError
from models.llama import checkpoint_tensors
from models.sources.hub import ADAPTER_FILES, ADAPTER_PICKLE, download_adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = ADAPTER_FILES
# PEFT saves the wrapped model's parameter names: base_model.model.<the model's own name>.lora_A.weight
PEFT_PREFIX = "base_model.model."
LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
# The only linears a merge may change: a decoder layer's. The embedding and a (possibly tied) output layer are left out.
LAYER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# adapter_config.json options that make an adapter more than W += scaling * B @ A on linears' weights.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (a magnitude vector per linear)",
    "lora_bias": "a bias on lora_B",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "modules_to_save": "whole modules saved beside the adapter (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "LoRA on parameters rather than modules (target_parameters)",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA",
}


@dataclass
class LoraFactors:
    """One targeted linear: W += scaling * B @ A, W being the checkpoint's tensor `weight`."""
    weight: str
    a: torch.Tensor = field(repr=False)  # [r, in features]
    b: torch.Tensor = field(repr=False)  # [out features, r]
    scaling: float

    def delta(self) -> torch.Tensor:
        # in fp32, in PEFT's own order (get_delta_weight: B @ A, then the scaling)
        return (self.b.float() @ self.a.float()) * self.scaling


@dataclass
class LoraAdapter:
    source: str  # "hub" or "local-folder"
    id: str  # the Hub repo id, or the folder's name
    revision: str | None
    r: int
    alpha: float
    use_rslora: bool
    target_modules: list[str]  # the kinds of linear it changes (q_proj, v_proj, ...)
    base_model: str | None  # adapter_config.json's base_model_name_or_path
    factors: dict[str, LoraFactors] = field(repr=False)  # the checkpoint's weight name -> its factors
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    # target_modules as adapter_config.json lists them; empty for 'all-linear' or a regular expression, which the
    # adapter's own tensors stand for
    listed_targets: list[str] = field(default_factory=list)

    def describe(self) -> dict:
        """model.adapter of report.json (recipes/output/report.py: AdapterInfo)."""
        described = {"source": self.source, "id": self.id, "revision": self.revision, "r": self.r,
                     "alpha": self.alpha, "target_modules": self.target_modules, "linears": len(self.factors)}
        if self.use_rslora:
            described["rslora"] = True
        if self.rank_pattern:
            described["rank_pattern"] = self.rank_pattern
        if self.alpha_pattern:
            described["alpha_pattern"] = self.alpha_pattern
        return described


def adapter_folder(name: str, revision: str | None, token: str | None, allow_pickle: bool,
                   progress=None) -> tuple[Path, str, str, str | None]:
    """(folder, source, id, revision) of what the user named: a local folder, read in place, or a Hub repo id,
    downloaded into the HF cache (its config and weights only)."""
    local = Path(name).expanduser()
    if local.is_dir():
        if revision:
            raise UserFacingError(f"--adapter-revision {revision!r} names a Hub revision, but the adapter {name!r} is "
                                  "a local folder; leave the revision out, or give the adapter's Hub repo id.")
        return local, "local-folder", local.resolve().name, None
    if local.exists() or name.startswith((".", "/", "~")):
        raise UserFacingError(f"the adapter {name!r} is not a folder; give a folder holding {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS} (what PEFT's save_pretrained writes), or a Hub repo id.")
    folder = download_adapter(name, revision=revision, token=token, allow_pickle=allow_pickle, progress=progress)
    return folder, "hub", name, revision or "main"


def load_adapter(name: str, revision: str | None = None, token: str | None = None, allow_pickle: bool = False,
                 progress=None) -> LoraAdapter:
    """The adapter's config and factors, its options checked; nothing of the checkpoint is read."""
    folder, source, ident, revision = adapter_folder(name, revision, token, allow_pickle, progress)
    where = f"the adapter {ident}"
    config = read_adapter_config(folder, where)
    check_adapter_options(config, where)
    tensors = read_adapter_tensors(folder, allow_pickle, where)
    r, alpha = config.get("r"), config.get("lora_alpha")
    use_rslora = bool(config.get("use_rslora"))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    factors = lora_factors(tensors, r, alpha, use_rslora, rank_pattern, alpha_pattern, where)
    targets = sorted({weight.split(".")[-2] for weight in factors})
    listed = config.get("target_modules")
    return LoraAdapter(source, ident, revision, r, alpha, use_rslora, targets, config.get("base_model_name_or_path"),
                       factors, rank_pattern, alpha_pattern,
                       listed_targets=sorted(listed) if isinstance(listed, list) else [])


def read_adapter_config(folder: Path, where: str) -> dict:
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        raise UserFacingError(f"{where} has no {ADAPTER_CONFIG}; give the folder (or Hub repo) PEFT's save_pretrained "
                              "wrote, which holds it beside the adapter's weights.")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserFacingError(f"{where}: {ADAPTER_CONFIG} is not valid JSON ({err}); download or save the adapter "
                              "again.") from None
    if not isinstance(config, dict):
        raise UserFacingError(f"{where}: {ADAPTER_CONFIG} is not a JSON object; save the adapter again with PEFT.")
    return config


def check_adapter_options(config: dict, where: str) -> None:
    """A plain LoRA on linears, nothing else: LoRA's type, no bias, none of the variants whose merge differs."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise UserFacingError(f"{where} is a {kind or 'untyped'} adapter (peft_type); Lowerbench merges LoRA "
                              "adapters only: give a LoRA adapter, or merge this one into the model with PEFT "
                              "(merge_and_unload) and give the merged model.")
    bias = config.get("bias", "none")
    if bias != "none":
        raise UserFacingError(f"{where} trains biases (bias {bias!r}), which a Llama's linears do not have; give a "
                              "LoRA adapter trained with bias 'none'.")
    for option, what in UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise UserFacingError(f"{where} uses {what}, which Lowerbench does not merge; merge it into the model "
                                  "with PEFT (merge_and_unload) and give the merged model instead.")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise UserFacingError(f"{where}: {ADAPTER_CONFIG}'s r is {r!r}; it must be a whole number of at least 1. "
                              "Save the adapter again with PEFT.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise UserFacingError(f"{where}: {ADAPTER_CONFIG}'s lora_alpha is {alpha!r}; it must be a number. Save the "
                              "adapter again with PEFT.")
    for name in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(name) or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) for v in pattern.values()):
            raise UserFacingError(f"{where}: {ADAPTER_CONFIG}'s {name} is not a map of module names to numbers; "
                                  "save the adapter again with PEFT.")


def read_adapter_tensors(folder: Path, allow_pickle: bool, where: str) -> dict[str, torch.Tensor]:
    weights, pickled = folder / ADAPTER_WEIGHTS, folder / ADAPTER_PICKLE
    if weights.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(weights)
        except (SafetensorError, OSError, ValueError) as err:
            raise UserFacingError(f"{where}: {ADAPTER_WEIGHTS} is corrupt or truncated ({err}); download or save the "
                                  "adapter again.") from None
    if pickled.is_file() and not allow_pickle:
        raise UserFacingError(f"{where} has only a pickle {ADAPTER_PICKLE}, which can run code when loaded; save it "
                              f"as {ADAPTER_WEIGHTS} (PEFT's default), or pass --allow-pickle if you trust the source.")
    if pickled.is_file():
        try:
            return torch.load(pickled, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises several types for a bad or unsafe pickle
            raise UserFacingError(f"{where}: {ADAPTER_PICKLE} could not be loaded with weights_only=True "
                                  f"({err}).") from None
    raise UserFacingError(f"{where} has no {ADAPTER_WEIGHTS}; give the folder (or Hub repo) PEFT's save_pretrained "
                          "wrote, with the adapter's weights beside its config.")


def lora_factors(tensors: dict[str, torch.Tensor], r: int, alpha: float, use_rslora: bool, rank_pattern: dict,
                 alpha_pattern: dict, where: str) -> dict[str, LoraFactors]:
    """The checkpoint's weight name -> its factors, for every A and B pair of the file, each pair's shapes checked
    against its rank (rank_pattern's, else r)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = LORA_TENSOR.fullmatch(name)
        if match is None or not name.startswith(PEFT_PREFIX):
            raise UserFacingError(f"{where} holds {name}, which is no LoRA A or B matrix of a linear (an embedding's "
                                  "LoRA or another method's tensor); give an adapter of LoRA on linears only.")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise UserFacingError(f"{where} holds no LoRA matrices; save the adapter again with PEFT.")
    factors = {}
    for module, pair in sorted(parts.items()):
        key = checkpoint_module(module)
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise UserFacingError(f"{where} has lora_A without lora_B or the other way round ({module}: no "
                                  f"lora_{missing}); download or save the adapter again.")
        a, b = pair["A"], pair["B"]
        rank = int(rank_pattern.get(pattern_key(rank_pattern, key, where), r))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise UserFacingError(f"{where}: {module}'s lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but its "
                                  f"rank is {rank} ({ADAPTER_CONFIG}'s r or rank_pattern): the config and the weights "
                                  "disagree; download or save the adapter again.")
        module_alpha = alpha_pattern.get(pattern_key(alpha_pattern, key, where), alpha)
        scaling = module_alpha / math.sqrt(rank) if use_rslora else module_alpha / rank
        factors[key + ".weight"] = LoraFactors(key + ".weight", a, b, scaling)
    return factors


def checkpoint_module(peft_module: str) -> str:
    """PEFT's name of a module (base_model.model.model.layers.0.self_attn.q_proj) as the checkpoint's
    (model.layers.0.self_attn.q_proj); an adapter trained on the bare decoder (LlamaModel) lacks the 'model.'."""
    name = peft_module.removeprefix(PEFT_PREFIX)
    return "model." + name if name.startswith("layers.") else name


def pattern_key(patterns: dict, module: str, where: str) -> str | None:
    """The key of rank_pattern or alpha_pattern that applies to a module, as PEFT matches them (get_pattern_key:
    the key, as a regular expression, matches the module's name or its end after a dot)."""
    for key in patterns:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as err:
            raise UserFacingError(f"{where}: the pattern {key!r} of rank_pattern or alpha_pattern is not a regular "
                                  f"expression ({err}); save the adapter again with PEFT.") from None
    return None


def check_adapter_base(adapter: LoraAdapter, model_id: str | None) -> None:
    """Refuses an adapter whose base model is another Hub model than the checkpoint. Where either is unknown (a
    local folder, a path on the trainer's disk) the shapes decide (check_adapter_fits)."""
    base = adapter.base_model
    if not model_id or not base or not _is_hub_id(base) or base.lower() == model_id.lower():
        return
    raise UserFacingError(f"the adapter {adapter.id} was trained on {base} (base_model_name_or_path), not on "
                          f"{model_id}: a LoRA changes the weights it was trained against. Give --model {base}, or "
                          "an adapter trained on this model.")


def check_adapter_fits(adapter: LoraAdapter, config) -> None:
    """Every linear the adapter changes is one of this Llama's decoder layers' and of the shape its A and B make;
    from the config alone, before any weight is read or downloaded."""
    where = f"the adapter {adapter.id}"
    expected = checkpoint_tensors(config)
    known = sorted({name.split(".")[-2] for name in expected if LAYER_LINEAR.fullmatch(name)})
    for listed in adapter.listed_targets:
        if not _targets_a_llama_linear(listed, expected):
            raise UserFacingError(f"{where} targets {listed!r}, which is none of a Llama's linears "
                                  f"({', '.join(LLAMA_LINEARS)}): it was made for another architecture; give an "
                                  "adapter trained on this model.")
    layers = config.num_hidden_layers
    for name, factors in adapter.factors.items():
        module = name.removesuffix(".weight")
        if not LAYER_LINEAR.fullmatch(name):
            raise UserFacingError(f"{where} changes {module}, which is not a linear of a decoder layer "
                                  f"({', '.join(known)}); Lowerbench merges LoRA on those only.")
        if name not in expected:
            raise UserFacingError(f"{where} changes {module}, but this model has {layers} decoder layers "
                                  f"(model.layers.0 to model.layers.{layers - 1}): it was trained on another model; "
                                  "give an adapter trained on this one.")
        out_features, in_features = expected[name]
        if factors.a.shape[1] != in_features or factors.b.shape[0] != out_features:
            raise UserFacingError(f"{where} maps {factors.a.shape[1]} inputs to {factors.b.shape[0]} outputs in "
                                  f"{module}, where this model has {in_features} inputs and {out_features} outputs: "
                                  "it was trained on another model; give an adapter trained on this one.")


def _targets_a_llama_linear(listed: str, expected: dict) -> bool:
    """Whether a target_modules entry names a Llama module as PEFT matches a list (the whole name or its end
    after a dot)."""
    modules = {name.removesuffix(".weight") for name in expected}
    return any(module == listed or module.endswith("." + listed) for module in modules)


def _is_hub_id(name: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "/", "~")) or Path(name).expanduser().exists():
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True
