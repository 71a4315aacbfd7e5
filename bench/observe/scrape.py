"""The server under test, seen from outside: its counters (``GET /metrics``), a free port for it."""

from __future__ import annotations

import socket
import time
import urllib.request

Samples = dict[str, float]


def scrape(base_url: str, timeout_s: float = 10.0) -> Samples:
    """Each series' ``name{labels}`` -> value, summed over the served versions (``parse``)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    return parse(text)


def parse(text: str) -> Samples:
    """Sample lines by ``name{labels}``, the ``model`` and ``version`` labels left out and the
    versions summed: a suite measures one model, read by the names it had before the labels."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            number = float(value)
        except ValueError:
            continue
        key = _without_version(key)
        out[key] = out.get(key, 0.0) + number
    return out


def _without_version(key: str) -> str:
    name, brace, labels = key.partition("{")
    if not brace:
        return key
    # Label values here are names, reasons and numbers: no comma inside a value.
    kept = [p for p in labels.rstrip("}").split(",") if not p.startswith(("model=", "version="))]
    return f"{name}{{{','.join(kept)}}}" if kept else name


def delta(after: Samples, before: Samples, key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


BATCH_ROWS = "shardserve_batch_size_rows"


def batches_and_rows(after: Samples, before: Samples) -> tuple[float, float]:
    """How many batches ran between two scrapes, and how many rows they held."""
    return delta(after, before, f"{BATCH_ROWS}_count"), delta(after, before, f"{BATCH_ROWS}_sum")


def mean_batch_rows(after: Samples, before: Samples) -> float:
    batches, rows = batches_and_rows(after, before)
    return rows / batches if batches else 0.0


def wait_idle(base_url: str, timeout_s: float, poll_s: float) -> None:
    """Until the server holds no queued row and no batch, so that one measurement's answers
    are not counted in the next one's (at most ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = scrape(base_url)
        if not samples.get("shardserve_queue_rows") and not samples.get(
            "shardserve_inflight_batches"
        ):
            return
        time.sleep(poll_s)  # another process's counters: there is no event to wait on


def base_url(predict_url: str) -> str:
    """``http://host:port/predict`` -> ``http://host:port``."""
    return predict_url.rsplit("/", 1)[0]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
