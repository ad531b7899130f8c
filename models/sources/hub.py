"""Download a Llama checkpoint from the Hugging Face Hub into the standard HF cache, refusing early
(before any byte of weights) what could not be loaded: no config, pickle-only weights, too large, or a
config the caller's check refuses (the job's memory estimate): config.json comes down first. A PEFT adapter
comes down the same way, its config and weights only (download_adapter)."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import psutil
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects, validate_repo_id

from models.sources.config import read_config
from models.errors import UserFacingError

try:  # huggingface_hub 2.x talks through its httpx fork, 1.x through httpx itself
    from httpx2 import TransportError
except ImportError:
    from httpx import TransportError

ESSENTIAL_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
]
SAFETENSORS_PATTERNS = ["*.safetensors"]
PICKLE_PATTERNS = ["*.bin", "*.pth", "*.pt", "*.ckpt"]
ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors"]
ADAPTER_PICKLE = "adapter_model.bin"
# Only top-level files: subfolders hold other formats (original/ consolidated .pth, onnx/, gguf/).
IGNORE_PATTERNS = ["*/*"]
REVISION_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/\-]{0,254}")
GB = 1e9


def download_from_hub(
    repo_id: str,
    revision: str | None = None,
    token: str | None = None,
    allow_pickle: bool = False,
    progress=None,
    check_config=None,
) -> Path:
    """Returns the snapshot folder in the HF cache; falls back to the cache when the Hub is unreachable.
    check_config(config) runs on the downloaded config.json before any weight is requested."""
    try:
        return _download(repo_id, revision, token, allow_pickle, progress or (lambda fraction, message: None),
                         check_config)
    except UserFacingError as err:
        raise _masked(err, token) from None


def download_adapter(repo_id: str, revision: str | None = None, token: str | None = None, allow_pickle: bool = False,
                     progress=None) -> Path:
    """A PEFT adapter's snapshot folder in the HF cache: adapter_config.json and adapter_model.safetensors (or,
    with allow_pickle and no safetensors, adapter_model.bin), nothing else; the cache when the Hub is unreachable."""
    progress = progress or (lambda fraction, message: None)
    try:
        endpoint = constants.ENDPOINT
        info = _repo_info(repo_id, revision, token, progress, f"the adapter {repo_id}")
        if info is None:
            return _from_cache(repo_id, revision, token, endpoint, progress, patterns=ADAPTER_FILES)
        siblings = {s.rfilename: s for s in info.siblings or []}
        patterns = adapter_patterns(repo_id, list(siblings), allow_pickle)
        size = sum(siblings[name].size or 0 for name in patterns if name in siblings)
        check_room(repo_id, disk=size, memory=size)
        try:
            folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns)
        except HfHubHTTPError as err:
            raise hub_error(err, repo_id, revision, endpoint) from None
        except (TransportError, OSError) as err:
            raise UserFacingError(f"the download of the adapter {repo_id} from {endpoint} was interrupted "
                                  f"({type(err).__name__}: {_one_line(err)}); run the same command again.") from None
        progress(0.0, f"Downloaded the adapter {repo_id} to {folder}")
        return Path(folder)
    except UserFacingError as err:
        raise _masked(err, token) from None


def adapter_patterns(repo_id: str, files: list[str], allow_pickle: bool) -> list[str]:
    if ADAPTER_FILES[0] not in files:
        raise UserFacingError(f"{repo_id} has no {ADAPTER_FILES[0]} at its top level, so it is not a PEFT adapter; "
                              "give the repo of a LoRA adapter (what PEFT's push_to_hub writes).")
    if ADAPTER_FILES[1] in files:
        return list(ADAPTER_FILES)
    if ADAPTER_PICKLE not in files:
        raise UserFacingError(f"{repo_id} has no adapter weights ({ADAPTER_FILES[1]}); give a repo with them.")
    if not allow_pickle:
        raise UserFacingError(f"{repo_id} has only a pickle {ADAPTER_PICKLE}, which can run code when loaded; ask "
                              f"for {ADAPTER_FILES[1]}, or pass --allow-pickle if you trust the source.")
    return [ADAPTER_FILES[0], ADAPTER_PICKLE]


def _masked(err: UserFacingError, token: str | None) -> UserFacingError:
    """The error with every token this process knows replaced by ***: a message never shows a secret."""
    message = str(err)
    for secret in (token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")):
        if secret:
            message = message.replace(secret, "***")
    return UserFacingError(message)


def _repo_info(repo_id: str, revision: str | None, token: str | None, progress, what: str):
    """The repo's file list with sizes, once its id and revision are checked; None when the Hub does not answer
    (unreachable, offline, or a server error), so the caller falls back to the cache."""
    check_repo_id(repo_id)
    check_revision(revision)
    progress(0.0, f"Looking up {what} on {constants.ENDPOINT}")
    try:
        return HfApi().model_info(repo_id, revision=revision, token=token, files_metadata=True)
    except (TransportError, OfflineModeIsEnabled):
        return None
    except HfHubHTTPError as err:
        if err.response is not None and err.response.status_code >= 500:
            return None
        raise hub_error(err, repo_id, revision, constants.ENDPOINT) from None


def _download(repo_id, revision, token, allow_pickle, progress, check_config=None) -> Path:
    endpoint = constants.ENDPOINT
    info = _repo_info(repo_id, revision, token, progress, repo_id)
    if info is None:
        return _from_cache(repo_id, revision, token, endpoint, progress, check_config)

    siblings = {s.rfilename: s for s in info.siblings or []}
    patterns = download_patterns(repo_id, list(siblings), allow_pickle)
    names = filter_repo_objects(siblings, allow_patterns=patterns, ignore_patterns=IGNORE_PATTERNS)
    to_fetch = [siblings[name] for name in names]
    total = sum(s.size or 0 for s in to_fetch)
    # Cached blobs are named by their etag (sha256 for LFS files, git oid otherwise) and need no new disk space.
    blobs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "blobs"
    new_bytes = sum(s.size or 0 for s in to_fetch if not (blobs / str(s.lfs.sha256 if s.lfs else s.blob_id)).exists())
    check_room(repo_id, disk=new_bytes, memory=total)
    if check_config is not None:
        try:
            config_file = hf_hub_download(repo_id, "config.json", revision=revision, token=token)
        except HfHubHTTPError as err:
            raise hub_error(err, repo_id, revision, endpoint) from None
        _check_config_file(Path(config_file), check_config)

    progress(0.05, f"Downloading {len(to_fetch)} files ({total / GB:.2f} GB) of {repo_id}")
    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns,
                                   ignore_patterns=IGNORE_PATTERNS)
    except HfHubHTTPError as err:
        raise hub_error(err, repo_id, revision, endpoint) from None
    except (TransportError, OSError) as err:  # OSError includes LocalEntryNotFoundError: a HEAD that failed
        raise UserFacingError(
            f"the download of {repo_id} from {endpoint} was interrupted ({type(err).__name__}: "
            f"{_one_line(err)}); re-run the same command to resume (finished files are kept in the cache)."
        ) from None
    progress(1.0, f"Downloaded {repo_id} to {folder}")
    return Path(folder)


def check_repo_id(repo_id: str) -> None:
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserFacingError(
            f"{repo_id!r} is not a valid Hugging Face repo id; give it as 'org/name' (letters, digits, '-', '_', "
            "'.'), e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'."
        ) from None


def check_revision(revision: str | None) -> None:
    if revision is None:
        return
    if not REVISION_RE.fullmatch(revision) or ".." in revision or "//" in revision or revision.endswith("/"):
        raise UserFacingError(
            f"{revision!r} is not a valid revision; give a branch or tag name (e.g. 'main') or a commit sha."
        )


def download_patterns(repo_id: str, files: list[str], allow_pickle: bool) -> list[str]:
    top_level = [f for f in files if "/" not in f]
    if "config.json" not in top_level:
        raise UserFacingError(
            f"{repo_id} has no config.json at its top level, so it is not a Transformers model; "
            "pick a Llama model repo (e.g. one whose files list config.json and model.safetensors)."
        )
    if any(f.endswith(".safetensors") for f in top_level):
        return ESSENTIAL_FILES + SAFETENSORS_PATTERNS
    pickles = list(filter_repo_objects(top_level, allow_patterns=PICKLE_PATTERNS))
    if not pickles:
        raise UserFacingError(
            f"{repo_id} has no weights (*.safetensors, *.bin); pick a repo that contains the model weights."
        )
    if not allow_pickle:
        raise UserFacingError(
            f"{repo_id} has only pickle weights ({', '.join(pickles)}), which can run code when loaded; "
            "convert them to safetensors, or pass --allow-pickle if you trust the source."
        )
    return ESSENTIAL_FILES + PICKLE_PATTERNS + ["pytorch_model.bin.index.json"]


def check_room(repo_id: str, disk: int, memory: int) -> None:
    cache = Path(constants.HF_HUB_CACHE)
    while not cache.exists():  # the cache may not exist yet: measure the disk it will be created on
        cache = cache.parent
    free = shutil.disk_usage(cache).free
    if disk > free:
        raise UserFacingError(
            f"{repo_id} needs {disk / GB:.1f} GB but only {free / GB:.1f} GB is free on the disk of the "
            f"Hugging Face cache ({constants.HF_HUB_CACHE}); free some space or set HF_HOME to a larger disk."
        )
    ram = psutil.virtual_memory().available * 0.8
    if memory > ram:
        raise UserFacingError(
            f"{repo_id} needs {memory / GB:.1f} GB of memory to load but only {ram / GB:.1f} GB (80% of the "
            "available RAM) can be used; pick a smaller model or close other programs."
        )


def hub_error(err: HfHubHTTPError, repo_id: str, revision: str | None, endpoint: str) -> UserFacingError:
    status = err.response.status_code if err.response is not None else None
    if isinstance(err, GatedRepoError):
        return UserFacingError(
            f"{repo_id} is gated: accept its license on {endpoint}/{repo_id} and give a token (HF_TOKEN, or the token box in the app) "
            "of an account that has access."
        )
    if isinstance(err, RepositoryNotFoundError):
        return UserFacingError(
            f"{repo_id} does not exist on {endpoint} or is private; check the spelling, or give a token "
            "(HF_TOKEN, or the token box in the app) that can read it."
        )
    if isinstance(err, RevisionNotFoundError):
        return UserFacingError(
            f"revision {revision!r} does not exist in {repo_id}; give an existing branch, tag or commit, e.g. 'main'."
        )
    if status == 401:
        return UserFacingError(
            f"the Hub at {endpoint} rejected the token as invalid or expired; create a new one at "
            f"{endpoint}/settings/tokens and pass it in HF_TOKEN or the app's token box."
        )
    if status == 403:
        return UserFacingError(
            f"the token is not allowed to read {repo_id}; give a token with read access to it."
        )
    return UserFacingError(
        f"the Hub at {endpoint} answered HTTP {status} for {repo_id} ({_one_line(err)}); try again later."
    )


def _check_config_file(config_file: Path, check_config) -> None:
    check_config(read_config(config_file.parent))


def _from_cache(repo_id, revision, token, endpoint, progress, check_config=None,
                patterns=ESSENTIAL_FILES + SAFETENSORS_PATTERNS) -> Path:
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=patterns,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=True,
        )
    except OSError:  # LocalEntryNotFoundError, or IncompleteSnapshotError for an interrupted first download
        raise UserFacingError(
            f"cannot reach the Hub at {endpoint} and {repo_id} (revision {revision or 'main'}) is not in the cache "
            f"({constants.HF_HUB_CACHE}); check the network connection and HF_ENDPOINT, then try again."
        ) from None
    if check_config is not None:
        _check_config_file(Path(folder) / "config.json", check_config)
    progress(1.0, f"Hub unreachable: using the cached copy of {repo_id} in {folder}")
    return Path(folder)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]
