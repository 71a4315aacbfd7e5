"""The one check that every error-path test makes of the body it got."""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson

# What must never reach a client: the detail of a failure belongs in the log.
_LEAKS = {
    "a traceback": re.compile(r"Traceback|File \""),
    "a process id": re.compile(r"pid="),
    "an IPv4 address": re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}\b"),
    "an IPv6 address": re.compile(
        r"(?<![\w:])(?:[0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}(?![\w:])"
        r"|(?<![\w:])(?:[0-9a-fA-F]{1,4}:)+:|::[0-9a-fA-F]{1,4}\b"
    ),
    "a host name": re.compile(r"\.(?:internal|local|localdomain)\b|\bip-\d+-\d+-\d+-\d+\b"),
    "an absolute path": re.compile(
        r"(?<![\w.])(?:~|/(?:home|tmp|usr|var|root|opt|etc|srv|mnt|Users|private|work|data))/"
    ),
    "an actor id": re.compile(r"actor_id"),
    "an object repr": re.compile(r"0x[0-9a-fA-F]{4,}"),
    "an ANSI escape": re.compile(r"\x1b\["),
}


def assert_clean_error(response_or_body: httpx.Response | bytes | str | dict[str, Any]) -> str:
    """Assert the body is ``{"error": "<one clean message>"}``; return the message."""
    body = response_or_body
    if isinstance(body, httpx.Response):
        body = body.content
    if isinstance(body, bytes | str):
        body = orjson.loads(body)
    assert isinstance(body, dict), f"error body is not a JSON object: {body!r}"
    message = body.get("error")
    assert isinstance(message, str) and message, f"no 'error' string in {body!r}"
    # The message as a client reads it, and the whole body as JSON (other keys, escapes).
    texts = (message, orjson.dumps(body).decode())
    for what, pattern in _LEAKS.items():
        assert not any(pattern.search(t) for t in texts), f"error body holds {what}: {body!r}"
    return message
