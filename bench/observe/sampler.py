"""The server's gauges over time: ``/metrics`` scraped every ``interval_s`` in a thread.

Each sample keeps the series whose names start with one of ``prefixes``, every label kept (the
model and version included, unlike ``bench.observe.scrape``): the replicas by state, the scale
events, the rollbacks. Times are seconds from ``start``, a ``time.perf_counter()`` value shared
with the load (``bench.load.timeline``), so a gauge's change and the replies line up. The pure
helpers read a list of samples: a gauge summed over the labels asked for, when a value changed,
the first sample a predicate holds for.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

Series = dict[str, float]

DEFAULT_PREFIXES = (
    "shardserve_replicas",
    "shardserve_scale_events_total",
    "shardserve_rollbacks_total",
    "shardserve_queue_rows",
    "shardserve_inflight_batches",
)


@dataclass(frozen=True)
class Sample:
    t_s: float
    series: Series
    extra: dict[str, Any] = field(default_factory=dict)


def parse_series(text: str, prefixes: Sequence[str]) -> Series:
    """``name{labels}`` -> value for the sample lines whose name starts with a prefix."""
    out: Series = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or not line.startswith(tuple(prefixes)):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def labels_of(key: str) -> tuple[str, dict[str, str]]:
    """``name{a="x",b="y"}`` -> (name, {a: x, b: y}); label values hold no comma here."""
    name, brace, rest = key.partition("{")
    if not brace:
        return key, {}
    pairs = (part.split("=", 1) for part in rest.rstrip("}").split(",") if "=" in part)
    return name, {k: v.strip('"') for k, v in pairs}


def total(series: Series, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    out = 0.0
    for key, value in series.items():
        got, have = labels_of(key)
        if got == name and all(have.get(k) == v for k, v in labels.items()):
            out += value
    return out


def label_values(series: Series, name: str, label: str) -> set[str]:
    """The values ``label`` takes among ``name``'s series."""
    return {have[label] for got, have in map(labels_of, series) if got == name and label in have}


def over_time(samples: Iterable[Sample], name: str, **labels: str) -> list[tuple[float, float]]:
    """(t, ``total(name, labels)``) for each sample."""
    return [(s.t_s, total(s.series, name, **labels)) for s in samples]


def changes(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points where the value differs from the one before (the first point included)."""
    out: list[tuple[float, float]] = []
    for t, value in points:
        if not out or value != out[-1][1]:
            out.append((t, value))
    return out


def first_at(
    samples: Iterable[Sample], holds: Callable[[Sample], bool], after_s: float = -1e18
) -> float | None:
    """The time of the first sample after ``after_s`` that ``holds``."""
    return next((s.t_s for s in samples if s.t_s > after_s and holds(s)), None)


def scrape_series(base_url: str, prefixes: Sequence[str], timeout_s: float = 5.0) -> Series:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        return parse_series(response.read().decode(), prefixes)


class Sampler:
    """``with Sampler(base, start) as sampler:`` -- ``sampler.samples`` fills every
    ``interval_s``; ``probes`` (name -> callable) add what else a suite reads each time."""

    def __init__(
        self,
        base_url: str,
        start: float,
        *,
        interval_s: float = 0.5,
        prefixes: Sequence[str] = DEFAULT_PREFIXES,
        probes: Mapping[str, Callable[[], Any]] | None = None,
    ) -> None:
        self.base_url = base_url
        self.start = start
        self.interval_s = interval_s
        self.prefixes = tuple(prefixes)
        self.probes = dict(probes or {})
        self.samples: list[Sample] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def sample_now(self) -> Sample | None:
        t = time.perf_counter() - self.start
        try:
            series = scrape_series(self.base_url, self.prefixes)
            extra = {name: probe() for name, probe in self.probes.items()}
        except (urllib.error.URLError, OSError, ValueError):
            self.errors += 1  # the server busy past the timeout: a gap in the record, no more
            return None
        sample = Sample(round(t, 3), series, extra)
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.is_set():
            tick = time.perf_counter()
            self.sample_now()
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - tick)))
