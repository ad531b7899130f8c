"""Whether the Hub (HF_ENDPOINT) answers at all, asked in a second: huggingface_hub retries a refused or timed-out
connection for about 25 s, too long for a page that estimates a job or suggests repos as a person types."""
from __future__ import annotations

import os
import socket
import time
from urllib.parse import urlsplit

from models.errors import UserFacingError

CONNECT_TIMEOUT_S = 2.0
REMEMBER_S = 15.0  # how long an answer stands, so typing does not knock on a dead port at every key
_ANSWERS: dict[str, tuple[float, bool]] = {}  # endpoint -> (when asked, reachable)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def reachable(url: str | None = None) -> bool:
    """A TCP connection to the endpoint's host opens; always True behind a proxy, which only a request can try."""
    url = url or endpoint()
    parts = urlsplit(url)
    if os.environ.get(f"{parts.scheme.upper()}_PROXY") or os.environ.get(f"{parts.scheme}_proxy"):
        return True
    asked = _ANSWERS.get(url)
    if asked is not None and time.monotonic() - asked[0] < REMEMBER_S:
        return asked[1]
    try:
        with socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                      timeout=CONNECT_TIMEOUT_S):
            answer = True
    except OSError:
        answer = False
    _ANSWERS[url] = (time.monotonic(), answer)
    return answer


def check_reachable(what: str) -> None:
    """Raises when the Hub cannot be reached; `what` says what was wanted from it."""
    if not reachable():
        raise UserFacingError(f"cannot reach the Hub at {endpoint()}, so {what}; check the network and HF_ENDPOINT.")
