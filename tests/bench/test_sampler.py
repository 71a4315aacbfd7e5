"""The /metrics sampler's pure parts: every label kept, gauges summed over the labels asked
for, the points where a value changed, and the first sample a condition holds for."""

from __future__ import annotations

from bench.observe.sampler import (
    DEFAULT_PREFIXES,
    Sample,
    changes,
    first_at,
    label_values,
    labels_of,
    over_time,
    parse_series,
    total,
)

TEXT = """# HELP shardserve_replicas Replicas of the model, by state
# TYPE shardserve_replicas gauge
shardserve_replicas{model="tokens",version="1",state="healthy"} 2.0
shardserve_replicas{model="tokens",version="1",state="starting"} 1.0
shardserve_replicas{model="tokens",version="2",state="healthy"} 1.0
shardserve_rollbacks_total{model="tokens",version="2",reason="errors"} 1.0
shardserve_request_latency_seconds_count{model="tokens",version="1",status="200"} 5.0
"""


def test_series_keep_every_label_and_only_the_names_asked_for() -> None:
    series = parse_series(TEXT, DEFAULT_PREFIXES)
    assert len(series) == 4 and not any("latency" in k for k in series)
    name, labels = labels_of('shardserve_replicas{model="tokens",version="1",state="healthy"}')
    assert name == "shardserve_replicas"
    assert labels == {"model": "tokens", "version": "1", "state": "healthy"}
    assert labels_of("up") == ("up", {})
    assert total(series, "shardserve_replicas", state="healthy") == 3.0
    assert total(series, "shardserve_replicas", version="1") == 3.0
    assert total(series, "shardserve_replicas", version="3") == 0.0
    assert label_values(series, "shardserve_replicas", "version") == {"1", "2"}
    assert label_values(series, "shardserve_rollbacks_total", "reason") == {"errors"}


def test_changes_and_the_first_sample_that_holds() -> None:
    def at(t: float, healthy: float) -> Sample:
        return Sample(t, {'shardserve_replicas{state="healthy"}': healthy})

    samples = [at(0.0, 1), at(0.5, 1), at(1.0, 2), at(1.5, 2), at(2.0, 1)]
    points = over_time(samples, "shardserve_replicas", state="healthy")
    assert changes(points) == [(0.0, 1.0), (1.0, 2.0), (2.0, 1.0)]
    two = lambda s: total(s.series, "shardserve_replicas") == 2  # noqa: E731
    assert first_at(samples, two) == 1.0
    assert first_at(samples, two, after_s=1.0) == 1.5
    assert first_at(samples, lambda s: False) is None
