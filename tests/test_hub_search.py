"""The repo box's suggestions (app.hub_suggestion_note): Llama-family repos from the Hub's model listing on
tests/hub_server.py, gated ones marked, and what it says when the Hub cannot be reached."""
import app


def test_the_repo_box_suggests_llama_repos_and_marks_the_gated_ones(hub, hub_repo_dirs):
    hub.add_repo("org/tiny-bert", hub_repo_dirs["full"], tags=("transformers", "bert"), pipeline_tag="fill-mask")
    hub.add_repo("org/popular-llama", hub_repo_dirs["full"], downloads=1000)
    choices, note = app.hub_suggestion_note("LLAMA", "")
    assert [repo for _, repo in choices][0] == "org/popular-llama"  # most downloaded first
    assert "org/tiny-bert" not in [repo for _, repo in choices] and note == ""
    labels = dict((repo, label) for label, repo in choices)
    assert "gated" in labels["org/gated-llama"] and "gated" not in labels["org/tiny-llama"]
    assert app.hub_suggestion_note("l", "") == ([], "")  # one letter asks nothing
    assert app.hub_suggestion_note("no-such-model", "")[1].startswith("No Llama-family repo on the Hub contains")


def test_an_unreachable_hub_leaves_the_box_taking_typed_text(hub, monkeypatch):
    from huggingface_hub import constants

    from tests.conftest import free_port

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    choices, note = app.hub_suggestion_note("smollm", "")
    assert choices == [] and note.startswith(f"cannot reach the Hub at {constants.ENDPOINT}")
    assert "a typed repo id still works" in note
