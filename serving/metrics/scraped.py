"""The series read at scrape time rather than counted as they happen: each stage actor's figures
(refreshed by each model's stats poll), each version's state (``serving.version.life``, read from
its state machine) and its replicas' health (read from its runner).
Registered by ``serving.metrics.series.Metrics``; every series carries the version's labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shards.pipeline.health import Health

__all__ = [
    "MODEL_LABELS",
    "REPLICA_STATES",
    "HealthCollector",
    "ModelKey",
    "StageCollector",
    "memory_figures",
]

# Every series is one served version's: these two labels first, then the series' own.
MODEL_LABELS = ("model", "version")
ModelKey = tuple[str, str]  # (name, version)
# shards.pipeline.health.ReplicaState's values: every one has a series, 0 included.
REPLICA_STATES = ("healthy", "suspect", "dead", "starting", "pending", "draining")


class StageCollector:
    """Per-stage figures reported by the shard actors, refreshed by each model's poller."""

    def __init__(self) -> None:
        self.snapshots: dict[ModelKey, list[dict[str, Any]]] = {}

    def collect(self) -> Iterator[Metric]:
        # Counters (exported with ``_total``) so that rate() works; an actor Ray restarts starts
        # again from 0, which Prometheus reads as a counter reset.
        calls = CounterMetricFamily(
            "shardserve_stage_calls",
            "Batches computed by a shard actor",
            labels=[*MODEL_LABELS, "replica", "stage"],
        )
        compute = CounterMetricFamily(
            "shardserve_stage_compute_seconds",
            "Total compute time of a shard actor",
            labels=[*MODEL_LABELS, "replica", "stage"],
        )
        memory = GaugeMetricFamily(
            "shardserve_stage_memory_bytes",
            "A shard actor's memory: planned peak (weights + activations + device overhead), "
            "measured RSS now and at its peak, its weights, its RSS once TensorFlow was imported "
            "(before any weight), and on a GPU TensorFlow's current and peak bytes",
            labels=[*MODEL_LABELS, "replica", "stage", "kind"],
        )
        # A copy: a model's poller or unload may change the dict while a scrape reads it.
        for key, rows in list(self.snapshots.items()):
            for row in rows:
                labels = [*key, str(row.get("replica", 0)), _stage_label(row)]
                calls.add_metric(labels, float(row.get("calls", 0)))
                compute.add_metric(labels, float(row.get("compute_seconds_total", 0.0)))
                for kind, value in memory_figures(row.get("memory")).items():
                    memory.add_metric([*labels, kind], float(value))
        yield calls
        yield compute
        yield memory


def memory_figures(report: Any) -> dict[str, int]:
    """The figures of a stage actor's memory report (``ShardActor.memory``) by kind."""
    if not isinstance(report, dict):
        return {}
    marks = report.get("rss_marks")
    figures = {
        "planned": report.get("planned_peak_bytes"),
        "measured": report.get("rss_bytes"),
        "measured_peak": report.get("rss_peak_bytes"),
        # What "measured" holds above TensorFlow is the stage's own: compared with its weights.
        "weights": report.get("weight_bytes"),
        "tensorflow_baseline": marks.get("tensorflow") if isinstance(marks, dict) else None,
    }
    gpu = report.get("gpu")
    if isinstance(gpu, dict):
        figures["gpu_measured"] = gpu.get("current")
        figures["gpu_measured_peak"] = gpu.get("peak")
    return {k: int(v) for k, v in figures.items() if isinstance(v, int | float)}


class HealthCollector:
    """Each version's state (from its state machine) and its replicas' health (from its
    runner), read at scrape time."""

    def __init__(self) -> None:
        self.sources: dict[ModelKey, Callable[[], Health]] = {}
        # key -> (its state now, every state it may be in): one series per state, 1 for its own
        self.states: dict[ModelKey, tuple[Callable[[], str], tuple[str, ...]]] = {}

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "shardserve_version_state",
            "1 for the state a served version is in (LOADING, WARMING, READY, DRAINING, "
            "RETIRED, FAILED), 0 for the others",
            labels=[*MODEL_LABELS, "state"],
        )
        for key, (now, names) in list(self.states.items()):
            current = now()
            for name in names:
                state.add_metric([*key, name], 1.0 if name == current else 0.0)
        yield state
        replicas = GaugeMetricFamily(
            "shardserve_replicas",
            "Replicas of the model, by state",
            labels=[*MODEL_LABELS, "state"],
        )
        rebuilds = CounterMetricFamily(
            "shardserve_replica_rebuilds",
            "Replicas rebuilt (new placement group and actors) after their actors were lost",
            labels=list(MODEL_LABELS),
        )
        recoveries = CounterMetricFamily(
            "shardserve_replica_recoveries",
            "Replicas back in the rotation after Ray restarted their stage actors",
            labels=list(MODEL_LABELS),
        )
        for key, source in list(self.sources.items()):
            health = source()
            for name in REPLICA_STATES:
                replicas.add_metric([*key, name], float(health.states.count(name)))
            rebuilds.add_metric(list(key), health.rebuilds)
            recoveries.add_metric(list(key), health.recoveries)
        yield replicas
        yield rebuilds
        yield recoveries


def _stage_label(row: dict[str, Any]) -> str:
    """A stage's label: its position in the pipeline, "3.1" for part 1 of a layer split across
    devices at stage 3 (``StageSpec.name``); the index from an actor that reports no label."""
    return str(row.get("stage", row.get("stage_index", 0)))
