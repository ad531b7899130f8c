"""The Llama config of what a person named (the built-in model, a local folder or .gguf file, a Hub repo id),
without reading or downloading a weight: what a job's estimate needs before the job is started."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from models.sources.builtin import converted_folder, is_complete
from models.sources.checkpoint import BUILTIN_ID, builtin_gguf_path
from models.sources.checkpoint import check_gguf_architecture, gguf_architecture
from models.sources.config import check_supported_config, read_config
from models.sources.consistency import check_config_sizes
from models.errors import UserFacingError
from models.sources.hub import check_repo_id, check_revision, hub_error
from models.sources.hub_reach import endpoint
from models.sources.hub_reach import reachable


def model_config(model: str | None, revision: str | None = None, token: str | None = None):
    """None: the built-in model. A Hub repo's config.json comes down once per repo, revision and token."""
    if not model:
        gguf = builtin_gguf_path()
        if gguf is None:  # on a Space without the wheel the built-in model comes from the Hub
            return hub_config(BUILTIN_ID, None, token)
        return builtin_config(str(gguf))
    local = Path(model).expanduser()
    if local.suffix == ".gguf":
        if not local.is_file():
            raise UserFacingError(f"GGUF file {model!r} does not exist; give the path of an existing .gguf file.")
        stat = local.stat()
        return gguf_config(str(local.resolve()), stat.st_mtime_ns, stat.st_size)
    if local.is_dir():
        return read_config(local)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):  # as load_checkpoint
        raise UserFacingError(f"local path {model!r} does not exist; give an existing folder or .gguf file.")
    return hub_config(model, revision, token)


@functools.lru_cache(maxsize=4)
def builtin_config(gguf: str):
    """The converted folder's config once the built-in GGUF was converted (models/sources/builtin.py), else the GGUF's."""
    folder = converted_folder(Path(gguf))
    if is_complete(folder):
        return read_config(folder)
    path = Path(gguf)
    return gguf_config(str(path), path.stat().st_mtime_ns, path.stat().st_size)


@functools.lru_cache(maxsize=16)
def gguf_config(path: str, _mtime_ns: int, _size: int):
    """Read as models/sources/checkpoint.py reads it (transformers parses the header and vocabulary: seconds, so kept)."""
    from transformers import AutoConfig

    path_ = Path(path)
    check_gguf_architecture(gguf_architecture(path_), path_.name)
    try:
        config = AutoConfig.from_pretrained(path_.parent, gguf_file=path_.name)
    except Exception as err:  # transformers raises many types for metadata it cannot read
        raise UserFacingError(f"{path_.name}'s metadata could not be read ({type(err).__name__}); convert the model "
                              "again or give its Hugging Face folder.") from None
    check_supported_config(config, path_.name)
    check_config_sizes(config, path_.name)
    return config


def hub_config(repo_id: str, revision: str | None, token: str | None):
    return _hub_config(endpoint(), repo_id, revision or None, token or None)


@functools.lru_cache(maxsize=64)
def _hub_config(endpoint: str, repo_id: str, revision: str | None, token: str | None):
    """config.json through huggingface_hub (HF_ENDPOINT, the token and the HF cache apply); from the cache when
    the Hub cannot be reached."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError

    check_repo_id(repo_id)
    check_revision(revision)
    offline = not reachable(endpoint)
    try:
        path = hf_hub_download(repo_id, "config.json", revision=revision, token=token, endpoint=endpoint,
                               local_files_only=offline)
    except HfHubHTTPError as err:
        raise hub_error(err, repo_id, revision, endpoint) from None
    except OSError:  # LocalEntryNotFoundError: not in the cache, and the Hub unreachable or cut off
        raise UserFacingError(f"cannot reach the Hub at {endpoint} and {repo_id}'s config.json is not in the cache; "
                              "check the network and HF_ENDPOINT.") from None
    return read_config(Path(path).parent)


def hub_weights_cached(repo_id: str, revision: str | None) -> bool:
    """The repo's weights are in the Hugging Face cache already (a single file, or a sharded one's index)."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(repo_id, name, revision=revision or None), str)
               for name in ("model.safetensors", "model.safetensors.index.json"))
