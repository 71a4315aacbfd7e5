"""The server under test, seen from outside: its counters (``GET /metrics``), a free port for it."""

from __future__ import annotations

import socket
import urllib.request

Samples = dict[str, float]


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples:
    """Each sample line's ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def delta(after: Samples, before: Samples, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def base_url(predict_url: str) -> str:
    """``http://host:port/predict`` -> ``http://host:port``."""
    return predict_url.rsplit("/", 1)[0]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
