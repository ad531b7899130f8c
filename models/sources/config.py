"""A checkpoint's config.json: read, and judged to be of a family Lowerbench computes (models/families/) before
anything else is read."""
from __future__ import annotations

import json
from pathlib import Path

from models.errors import UserFacingError, last_line
from models.families import families, family_named


def supported_families() -> str:
    return "; ".join(f"{family.name} ({', '.join(family.architectures)})" for family in families().values())


def check_supported_config(config, where: str) -> None:
    """Refuses a config whose architecture (or, naming none, model_type) no family takes: a state-space model,
    a mixture of experts, an encoder."""
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if family_named(config) is not None:
        return
    what = f"a {', '.join(architectures)} (model_type {model_type!r})" if architectures else \
        f"of model_type {model_type!r}"
    raise UserFacingError(
        f"{where} is {what}, which Lowerbench does not compute. It takes dense decoder-only models of these "
        f"families: {supported_families()}. Choose a checkpoint of one of them (a mixture-of-experts or state-space "
        "model has no dense form here); a new Llama-like family is one file in models/families/."
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
    check_supported_config(_RawConfig(raw), str(folder))
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
    """Lets check_supported_config judge config.json before transformers parses (and maybe rejects) it."""

    def __init__(self, raw: dict):
        self.architectures = raw.get("architectures")
        self.model_type = raw.get("model_type")
