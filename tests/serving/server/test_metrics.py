"""What /metrics exports: counters for what only grows (``rate()`` needs them), and the README's
metrics table naming every family with its type."""

from __future__ import annotations

import re
from pathlib import Path

from serving.batching.record import BatchRecord
from serving.server.metrics import Metrics
from shards.pipeline.health import Health

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def exported(metrics: Metrics) -> dict[str, str]:
    """Family name as scraped (``_total`` included for counters) -> Prometheus type."""
    text = metrics.render().decode()
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))


def full_metrics() -> Metrics:
    metrics = Metrics()
    metrics.set_stage_stats(
        [
            {
                "replica": 0,
                "stage_index": 1,
                "calls": 7,
                "compute_seconds_total": 0.25,
                "memory": {"planned_peak_bytes": 10, "rss_bytes": 20, "rss_peak_bytes": 30},
            }
        ]
    )
    metrics.bind_health(lambda: Health(replicas=1, healthy=1, states=("healthy",)))
    return metrics


def test_stage_calls_and_compute_seconds_are_counters() -> None:
    metrics = full_metrics()
    text = metrics.render().decode()

    assert 'shardserve_stage_calls_total{replica="0",stage="1"} 7.0' in text
    assert 'shardserve_stage_compute_seconds_total{replica="0",stage="1"} 0.25' in text
    types = exported(metrics)
    assert types["shardserve_stage_calls_total"] == "counter"
    assert types["shardserve_stage_compute_seconds_total"] == "counter"
    assert "shardserve_stage_calls" not in types
    assert "shardserve_stage_compute_seconds" not in types


def test_every_exported_metric_is_in_the_readme_table_with_its_type() -> None:
    rows = dict(re.findall(r"^\| `(shardserve_\w+)` \| (\w+) \|", README, re.MULTILINE))
    # prometheus_client's own ``*_created`` timestamps are not ours to document.
    types = {k: v for k, v in exported(full_metrics()).items() if not k.endswith("_created")}

    assert rows == types


def test_padded_positions_count_real_and_pad_positions_of_length_padded_batches() -> None:
    metrics = Metrics()
    batch = {"size": 2, "padded_size": 2, "reason": "full", "queue_wait_s": 0.0, "run_s": 0.0}
    metrics.observe_batch(BatchRecord(**batch, ok=True, positions=23, padded_positions=41))
    metrics.observe_batch(BatchRecord(**batch, ok=True))  # no length padding: counts nothing
    text = metrics.render().decode()
    assert 'shardserve_padded_positions_total{kind="real"} 23.0' in text
    assert 'shardserve_padded_positions_total{kind="pad"} 41.0' in text
    assert exported(metrics)["shardserve_padded_positions_total"] == "counter"
