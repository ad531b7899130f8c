"""Repos of the families Lowerbench computes (models/families/) whose id contains what a person typed, for the repo
box to suggest: the Hub's, most downloaded first (through huggingface_hub, so HF_ENDPOINT and the token apply), then
the families' own example repos."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from models.errors import UserFacingError
from models.families import example_repos, families
from models.sources.hub import TransportError
from models.sources.hub_reach import check_reachable, endpoint

SHOWN = 10
# the Hub's listing is asked for this many times SHOWN, and the repos of other architectures are left out
LISTED_PER_SHOWN = 5
MIN_CHARACTERS = 2  # fewer match too much of the Hub to be worth a request


@dataclass(frozen=True)
class RepoSuggestion:
    repo_id: str
    gated: bool
    downloads: int | None

    @property
    def label(self) -> str:
        marks = [*(["gated: accept its license and give a token"] if self.gated else []),
                 *([f"{self.downloads:,} downloads"] if self.downloads is not None else [])]
        return " · ".join([self.repo_id, *marks])


def suggest_repos(text: str, token: str | None = None) -> list[RepoSuggestion]:
    """Text-generation repos of a supported family whose id contains `text` (none for fewer than MIN_CHARACTERS)."""
    text = (text or "").strip()
    if len(text) < MIN_CHARACTERS:
        return []
    check_reachable("the repo box cannot suggest repos (a typed repo id still works)")
    found = list(_search(endpoint(), text, token or None))
    listed = {s.repo_id for s in found}
    examples = [RepoSuggestion(repo, False, None) for repo in example_repos()
                if text.lower() in repo.lower() and repo not in listed]
    return (found + examples)[:SHOWN]


@functools.lru_cache(maxsize=256)
def _search(endpoint: str, text: str, token: str | None) -> tuple[RepoSuggestion, ...]:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    # the Hub tags a repo with its config's model_type
    model_types = {model_type for family in families().values() for model_type in family.model_types}
    try:
        models = list(HfApi(endpoint=endpoint, token=token).list_models(
            search=text, sort="downloads", limit=SHOWN * LISTED_PER_SHOWN,
            expand=["gated", "downloads", "pipeline_tag", "tags"]))
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        advice = "check the token" if status == 401 else "try again later"
        raise UserFacingError(f"the Hub at {endpoint} answered HTTP {status} to a search; {advice} "
                              "(a typed repo id still works).") from None
    except TransportError as err:  # the connection opened, then the request failed
        raise UserFacingError(f"the Hub at {endpoint} did not answer a search ({type(err).__name__}); a typed repo id "
                              "still works.") from None
    return tuple(RepoSuggestion(m.id, bool(m.gated), m.downloads) for m in models
                 if m.pipeline_tag in (None, "text-generation") and model_types & set(m.tags or ()))[:SHOWN]
