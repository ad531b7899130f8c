"""The repo box's suggestions (app.hub_suggestion_note): repos of the supported families from the Hub's listing on
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
    assert app.hub_suggestion_note("no-such-model", "")[1].startswith("No repo of a supported family on the Hub contains")


def test_an_unreachable_hub_leaves_the_box_taking_typed_text(hub, monkeypatch):
    from huggingface_hub import constants

    from tests.conftest import free_port

    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    choices, note = app.hub_suggestion_note("smollm", "")
    assert choices == [] and note.startswith(f"cannot reach the Hub at {constants.ENDPOINT}")
    assert "a typed repo id still works" in note


def test_the_repo_box_suggests_repos_of_every_family_and_the_families_examples(hub, hub_repo_dirs):
    """A repo the Hub tags with a supported family's model_type is suggested, one of a mixture of experts is not, and
    the example repos the family files declare follow the Hub's."""
    from models.families import families

    hub.add_repo("org/tiny-qwen3", hub_repo_dirs["full"], tags=("transformers", "qwen3"), downloads=5)
    hub.add_repo("org/tiny-qwen3-moe", hub_repo_dirs["full"], tags=("transformers", "qwen3_moe"), downloads=9)
    choices, note = app.hub_suggestion_note("qwen", "")
    repos = [repo for _, repo in choices]
    assert repos[0] == "org/tiny-qwen3" and "org/tiny-qwen3-moe" not in repos and note == ""
    examples = [repo for family in families().values() for repo in family.example_repos if "qwen" in repo.lower()]
    assert "Qwen/Qwen3-0.6B" in examples and repos[1:] == examples
