"""The Llama-like model families, one file each: what a family's config.json names (architectures, model_type), how
its module differs from Llama's (choices of models/module_options.py LlamaShape), how its checkpoint's tensor names
map onto the module's (fused tensors split by rows), exact weight folds, its GGUF architecture, its rotary
embedding and a few Hub repos to suggest. A family registers itself; the module and everything after it stay shared
and name no family. A new family is a new file here."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # the app's first lines read the families before its thread policy lets torch load
    from models.module_options import LlamaShape

FAMILIES: dict[str, "Family"] = {}
LLAMA_ROTARY = "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding"

# How many rows each of the module's linears has, for splitting a checkpoint's fused tensor by rows.
_ROWS: dict[str, Callable[[LlamaShape], int]] = {
    "self_attn.q_proj": lambda s: s.n_heads * s.head_dim,
    "self_attn.k_proj": lambda s: s.n_kv_heads * s.head_dim,
    "self_attn.v_proj": lambda s: s.n_kv_heads * s.head_dim,
    "mlp.gate_proj": lambda s: s.intermediate,
    "mlp.up_proj": lambda s: s.intermediate,
}


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    # the general.architecture of its GGUF files that transformers reads; None: transformers reads none
    gguf_architecture: str | None = None
    # transformers' rotary embedding class for it (module path and name): the module takes cos/sin from it
    rotary: str = LLAMA_ROTARY
    # the LlamaShape fields in which its module differs from Llama's, from its config
    differences: Callable[[object], dict] = lambda config: {}
    # a checkpoint tensor holding several of the module's linears, rows stacked in order: fused -> parts
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # exact weight folds, from its config: a parameter-name ending (Llama's names) -> the factor its tensor takes
    folds: Callable[[object], dict[str, float]] = lambda config: {}
    example_repos: tuple[str, ...] = ()

    def shape(self, config) -> LlamaShape:
        from models.module_options import LlamaShape  # loads torch

        return dataclasses.replace(LlamaShape.from_config(config), **self.differences(config))

    def source(self, name: str, shape: LlamaShape) -> tuple[str, slice | None]:
        """The checkpoint tensor one of the module's (unfused, Llama-named) parameters is read from, and its rows
        there (None: the whole tensor)."""
        for fused, parts in self.fused.items():
            for i, part in enumerate(parts):
                marker = f".{part}."
                if marker in name:
                    start = sum(_ROWS[p](shape) for p in parts[:i])
                    return name.replace(marker, f".{fused}."), slice(start, start + _ROWS[part](shape))
        return name, None

    def fold(self, config, name: str) -> float:
        """The factor a parameter takes at load (1.0: none)."""
        return math.prod(factor for ending, factor in self.folds(config).items() if name.endswith(ending))

    def rotary_embedding(self, config):
        module_name, _, class_name = self.rotary.rpartition(".")
        return getattr(importlib.import_module(module_name), class_name)(config)


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every family in this folder, by name."""
    _import_family_files()
    return FAMILIES


@functools.cache
def _import_family_files() -> None:
    # once per process: module shapes and checkpoint names ask for the family on every build and estimate
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def family_named(config) -> Family | None:
    """The family whose architectures hold the config's (its model_type when it names none); None if no family does."""
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for family in families().values():
        if set(architectures) & set(family.architectures) or (not architectures and model_type in family.model_types):
            return family
    return None


def family_for(config) -> Family:
    """The config's family; a config that names none is read as a Llama (models/sources/config.py refused
    every other before a module is built)."""
    return family_named(config) or families()["llama"]


def family_of_gguf(architecture: str) -> Family | None:
    return next((f for f in families().values() if f.gguf_architecture == architecture), None)


def module_shape(config) -> LlamaShape:
    """The module's shape and choices for this config, its family's differences included."""
    return family_for(config).shape(config)


def supported_architectures() -> list[str]:
    return [name for family in families().values() for name in family.architectures]


def example_repos() -> list[str]:
    return [repo for family in families().values() for repo in family.example_repos]
