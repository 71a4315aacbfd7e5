"""The ragged bench's checks: answers read back and compared with each row alone, the
length-padding waste read from ``/metrics``, and what a server says about its length padding."""

from __future__ import annotations

import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.models.ragged import SINGLE, Answer, Row, body
from bench.observe.scrape import Samples, delta

PADDED_POSITIONS = "shardserve_padded_positions_total"


class CheckError(RuntimeError):
    """A server refused or failed a row of the exactness sample."""


def positions(after: Samples, before: Samples) -> dict[str, float]:
    """The real and pad positions of the batches run between two scrapes (every other label
    summed over)."""
    out = {"real": 0.0, "pad": 0.0}
    for key in after.keys() | before.keys():
        if not key.startswith(PADDED_POSITIONS + "{"):
            continue
        for kind in out:
            if f'kind="{kind}"' in key:
                out[kind] += delta(after, before, key)
    return out


def waste(counted: dict[str, float]) -> float | None:
    """Pad positions per real position; None when no batch was length padded."""
    return counted["pad"] / counted["real"] if counted["real"] else None


def decode(answer: bytes) -> Answer:
    """The one row of a TF-Serving row-form answer, by output name (``SINGLE`` for a model of
    one output)."""
    prediction: Any = orjson.loads(answer)["predictions"][0]
    if isinstance(prediction, dict):
        return {name: np.asarray(v, dtype=np.float64) for name, v in prediction.items()}
    return {SINGLE: np.asarray(prediction, dtype=np.float64)}


def max_abs_diff(got: list[Answer], want: list[Answer]) -> tuple[float | None, list[str]]:
    """The largest absolute difference between two sets of answers, and what could not be
    compared (a missing output, a shape that differs: the difference is then None)."""
    worst = 0.0
    problems = []
    for i, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        for name, value in theirs.items():
            label = name or "the output"
            if name not in mine:
                problems.append(f"row {i}: no {label!r} in the answer (it has {sorted(mine)})")
            elif mine[name].shape != value.shape:
                problems.append(
                    f"row {i}: {label} has shape {mine[name].shape}, the row alone {value.shape}"
                )
            elif value.size:
                worst = max(worst, float(np.max(np.abs(mine[name] - value))))
    return (None if problems else worst), problems


def ask(url: str, rows: list[Row], *, together: bool) -> list[Answer]:
    """Each row as a request of its own: all at once, so that they share batches, or one after
    another, so that each is alone in its batch."""
    bodies = [body([row]) for row in rows]
    if not together:
        return [_post(url, one) for one in bodies]
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        return list(pool.map(lambda one: _post(url, one), bodies))


def _post(url: str, one: bytes) -> Answer:
    request = urllib.request.Request(
        url, data=one, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return decode(response.read())
    except urllib.error.HTTPError as exc:
        raise CheckError(f"{exc.code} {exc.read()[:300]!r} to a row of the sample") from None


def model_metadata(base: str, model: str) -> dict[str, Any]:
    """The model's V2 metadata: its inputs, and in ``parameters`` the length padding in force."""
    with urllib.request.urlopen(f"{base}/v2/models/{model}", timeout=10) as response:
        metadata: Any = orjson.loads(response.read())
    if not isinstance(metadata, dict):
        raise CheckError(f"the V2 metadata of {model!r} is not an object: {metadata!r:.300}")
    return metadata


def length_padding_lines(log: Path, most: int = 5) -> list[str]:
    """The server log's lines about length padding (the warm-up's verdict among them)."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if "length padding" in line.lower()][:most]
