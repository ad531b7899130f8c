"""models/sources/hub.py against a real HTTP server speaking the Hub API (tests/hub_server.py), through the real
huggingface_hub client."""
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import load_file

from models.errors import UserFacingError
from models.sources.hub import download_from_hub
from tests.conftest import BAD_TOKEN, GOOD_TOKEN, OTHER_TOKEN

NEEDED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def refused(**kwargs) -> str:
    repo_id = kwargs.pop("repo_id")
    with pytest.raises(UserFacingError) as info:
        download_from_hub(repo_id, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    for token in (GOOD_TOKEN, OTHER_TOKEN, BAD_TOKEN):
        assert token not in message
    return message


def test_download_fetches_only_needed_files_then_works_offline(hub, hub_repo_dirs):
    steps = []
    folder = download_from_hub("org/tiny-llama", progress=lambda fraction, message: steps.append(fraction))

    assert folder.is_relative_to(constants.HF_HUB_CACHE)
    assert {p.name for p in folder.iterdir()} == NEEDED
    for name in NEEDED:
        assert (folder / name).read_bytes() == (hub_repo_dirs["full"] / name).read_bytes()
    assert hub.requested_files("org/tiny-llama") == NEEDED
    assert steps[0] == 0.0 and steps[-1] == 1.0
    assert not list(Path(constants.HF_HUB_CACHE).rglob("*.incomplete"))

    hub.stop()
    assert download_from_hub("org/tiny-llama") == folder
    message = refused(repo_id="org/gated-llama")
    assert "cannot reach the Hub at " + hub.endpoint in message and "not in the cache" in message


def test_revisions_by_branch_and_commit(hub):
    sha = hub.repos["org/tiny-llama"].sha
    assert download_from_hub("org/tiny-llama", revision="v1").name == sha
    assert download_from_hub("org/tiny-llama", revision=sha).name == sha
    message = refused(repo_id="org/tiny-llama", revision="nope")
    assert "'nope'" in message and "'main'" in message


def test_gated_repo_needs_a_token_with_access(hub):
    assert "gated" in refused(repo_id="org/gated-llama")
    message = refused(repo_id="org/gated-llama", token=OTHER_TOKEN)
    assert "gated" in message and "license" in message and hub.endpoint + "/org/gated-llama" in message
    assert not hub.requested_files("org/gated-llama")
    assert {p.name for p in download_from_hub("org/gated-llama", token=GOOD_TOKEN).iterdir()} == NEEDED


@pytest.mark.parametrize("via_env", [False, True])
def test_invalid_token_is_reported_without_echoing_it(hub, monkeypatch, via_env):
    if via_env:
        monkeypatch.setenv("HF_TOKEN", BAD_TOKEN)
    message = refused(repo_id="org/tiny-llama", token=None if via_env else BAD_TOKEN)
    assert "invalid or expired" in message and "settings/tokens" in message


def test_token_given_as_repo_id_is_masked(hub):
    # A swapped argument order must not print the secret back.
    message = refused(repo_id=GOOD_TOKEN, token=GOOD_TOKEN)
    assert "does not exist" in message and "***" in message


def test_missing_repo(hub):
    message = refused(repo_id="org/does-not-exist")
    assert "org/does-not-exist does not exist" in message and "token" in message


@pytest.mark.parametrize("repo_id", ["../../etc", "a b", "https://x", "org/x/y", ""])
def test_malformed_repo_id_is_refused_before_any_request(hub, repo_id):
    assert "not a valid Hugging Face repo id" in refused(repo_id=repo_id)
    assert hub.log == []


@pytest.mark.parametrize("revision", ["../main", "a b", "main\n", "-x"])
def test_malformed_revision_is_refused_before_any_request(hub, revision):
    assert "not a valid revision" in refused(repo_id="org/tiny-llama", revision=revision)
    assert hub.log == []


def test_pickle_only_repo_needs_allow_pickle(hub):
    message = refused(repo_id="org/pickle-llama")
    assert "pytorch_model.bin" in message and "safetensors" in message and "--allow-pickle" in message
    assert not hub.requested_files("org/pickle-llama")

    folder = download_from_hub("org/pickle-llama", allow_pickle=True)
    assert "pytorch_model.bin" in {p.name for p in folder.iterdir()}


def test_repo_without_config_is_refused(hub):
    assert "no config.json" in refused(repo_id="org/no-config")
    assert not hub.requested_files("org/no-config")


def test_too_large_repo_is_refused_before_downloading(hub):
    message = refused(repo_id="org/huge-llama")
    assert "10995.1 GB" in message and "free on the disk" in message
    assert not hub.requested_files("org/huge-llama")


def test_cached_weights_need_memory_but_no_new_disk(hub):
    download_from_hub("org/tiny-llama")
    hub.repos["org/tiny-llama"].reported_sizes["model.safetensors"] = 10 * 1024**4
    message = refused(repo_id="org/tiny-llama")
    assert "10995.1 GB of memory" in message and "RAM" in message


def test_connection_lost_mid_download_then_resumed(hub):
    hub.drop_downloads.add("model.safetensors")
    message = refused(repo_id="org/tiny-llama")
    assert "interrupted" in message and "re-run" in message
    assert not list(Path(constants.HF_HUB_CACHE).rglob("snapshots/*/model.safetensors"))

    hub.drop_downloads.clear()
    folder = download_from_hub("org/tiny-llama")
    assert {p.name for p in folder.iterdir()} == NEEDED


def test_load_checkpoint_from_hub(hub, tiny_llama_dir):
    from models.sources.checkpoint import load_checkpoint

    ckpt = load_checkpoint("org/tiny-llama")
    assert ckpt.source == "hub" and ckpt.id == "org/tiny-llama" and ckpt.revision == "main"
    expected = load_file(tiny_llama_dir / "model.safetensors")
    assert ckpt.state_dict.keys() == expected.keys()
    assert all(torch.equal(ckpt.state_dict[k], expected[k].float()) for k in expected)
    assert ckpt.tokenizer("hello world")["input_ids"] == [ckpt.tokenizer.convert_tokens_to_ids("hello"),
                                                         ckpt.tokenizer.convert_tokens_to_ids("world")]
