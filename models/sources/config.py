"""A checkpoint's config.json: read, and judged to be a Llama before anything else is read."""
from __future__ import annotations

import json
from pathlib import Path

from models.errors import UserFacingError, last_line

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


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

    # loads torch (the rope check builds the rotary embedding), which an entry point lets load only after its
    # thread policy is set, and models.sources.hub, imported by the app's first lines, imports this module
    from models.sources.consistency import check_config_sizes

    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserFacingError(f"{folder} has no config.json; give a Hugging Face model folder or a .gguf file.")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserFacingError(f"{config_file} is not valid JSON ({err}); re-download the model.") from None
    if not isinstance(raw, dict):
        raise UserFacingError(f"{config_file} holds a JSON {type(raw).__name__}, not an object of settings; "
                              "re-download the model.")
    check_llama_config(_RawConfig(raw), str(folder))
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # transformers' validators raise several types, the reason on the error's last line
        reason = last_line(err) or type(err).__name__
        raise UserFacingError(f"{folder}: config.json does not hold together ({reason}); fix config.json or "
                              "re-download the model.") from None
    config.quantization_config = None
    check_config_sizes(config, str(folder))
    return config


class _RawConfig:
    """Lets check_llama_config judge config.json before transformers parses (and maybe rejects) it."""

    def __init__(self, raw: dict):
        self.architectures = raw.get("architectures")
        self.model_type = raw.get("model_type")
