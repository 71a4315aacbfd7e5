"""Prometheus metrics of one server. Each app gets its own registry (tests build many apps)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serving.batching.record import BatchRecord
from shards.pipeline.health import Health

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _StageCollector:
    """Per-stage figures reported by the shard actors, refreshed by the app's poller."""

    def __init__(self) -> None:
        self.snapshot: list[dict[str, Any]] = []

    def collect(self) -> Iterator[Metric]:
        # Counters (exported with ``_total``) so that rate() works; an actor Ray restarts starts
        # again from 0, which Prometheus reads as a counter reset.
        calls = CounterMetricFamily(
            "shardserve_stage_calls",
            "Batches computed by a shard actor",
            labels=["replica", "stage"],
        )
        compute = CounterMetricFamily(
            "shardserve_stage_compute_seconds",
            "Total compute time of a shard actor",
            labels=["replica", "stage"],
        )
        memory = GaugeMetricFamily(
            "shardserve_stage_memory_bytes",
            "A shard actor's memory: planned peak (weights + activations + device overhead), "
            "measured RSS now and at its peak, and on a GPU TensorFlow's current and peak bytes",
            labels=["replica", "stage", "kind"],
        )
        for row in self.snapshot:
            labels = [str(row.get("replica", 0)), str(row.get("stage_index", 0))]
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
    figures = {
        "planned": report.get("planned_peak_bytes"),
        "measured": report.get("rss_bytes"),
        "measured_peak": report.get("rss_peak_bytes"),
    }
    gpu = report.get("gpu")
    if isinstance(gpu, dict):
        figures["gpu_measured"] = gpu.get("current")
        figures["gpu_measured_peak"] = gpu.get("peak")
    return {k: int(v) for k, v in figures.items() if isinstance(v, int | float)}


class _HealthCollector:
    """Replica health read from the runner at scrape time."""

    def __init__(self) -> None:
        self.source: Callable[[], Health] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        health = self.source()
        replicas = GaugeMetricFamily(
            "shardserve_replicas", "Replicas of the model, by state", labels=["state"]
        )
        for name in ("healthy", "suspect", "dead"):
            replicas.add_metric([name], float(health.states.count(name)))
        yield replicas
        yield CounterMetricFamily(
            "shardserve_replica_rebuilds",
            "Replicas rebuilt (new placement group and actors) after their actors were lost",
            value=health.rebuilds,
        )
        yield CounterMetricFamily(
            "shardserve_replica_recoveries",
            "Replicas back in the rotation after Ray restarted their stage actors",
            value=health.recoveries,
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_latency = Histogram(
            "shardserve_request_latency_seconds",
            "Time from request received to response ready",
            ["status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejects = Counter(
            "shardserve_rejects_total",
            "Requests refused or failed, by reason",
            ["reason"],
            registry=r,
        )
        self.batch_size = Histogram(
            "shardserve_batch_size_rows", "Real rows per batch", buckets=_BATCH_BUCKETS, registry=r
        )
        self.batch_padded = Histogram(
            "shardserve_batch_padded_size_rows",
            "Rows per batch after padding",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.positions = Counter(
            "shardserve_padded_positions",
            "Positions of length-padded batches: real (the rows' own lengths) or pad (added to "
            "reach the batch's length bucket: the waste)",
            ["kind"],
            registry=r,
        )
        # Both series from the start: a rate of the waste reads 0, not absent, before padding.
        self._real_positions = self.positions.labels("real")
        self._pad_positions = self.positions.labels("pad")
        self.batch_close = Counter(
            "shardserve_batch_close_total", "Batches by close reason", ["reason"], registry=r
        )
        self.queue_wait = Histogram(
            "shardserve_queue_wait_seconds",
            "Wait of a batch's oldest row before dispatch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_run = Histogram(
            "shardserve_batch_run_seconds",
            "Time of a batch through the pipeline",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_rows = Gauge("shardserve_queue_rows", "Rows waiting in the queue", registry=r)
        self.inflight = Gauge("shardserve_inflight_batches", "Batches in the pipeline", registry=r)
        self.effective_wait = Gauge(
            "shardserve_batch_wait_ms", "Current wait of the batching policy", registry=r
        )
        self.isolations = Counter(
            "shardserve_poison_isolations_total",
            "Requests failed alone after their batch was split to find the rows the model "
            "raises on (their batch-mates were answered)",
            registry=r,
        )
        # Children by label, taken once: ``labels()`` costs a lock and a dict of label values
        # on every call, and these two are on every request's path.
        self._latency_by_status: dict[int, Any] = {}
        self._rejects_by_reason: dict[str, Any] = {}
        self.stages = _StageCollector()
        r.register(self.stages)  # type: ignore[arg-type]
        self.health = _HealthCollector()
        r.register(self.health)  # type: ignore[arg-type]

    def observe_latency(self, status: int, seconds: float) -> None:
        child = self._latency_by_status.get(status)
        if child is None:
            child = self._latency_by_status[status] = self.request_latency.labels(str(status))
        child.observe(seconds)

    def reject(self, reason: str) -> None:
        child = self._rejects_by_reason.get(reason)
        if child is None:
            child = self._rejects_by_reason[reason] = self.rejects.labels(reason)
        child.inc()

    def observe_batch(self, record: BatchRecord) -> None:
        self.batch_size.observe(record.size)
        self.batch_padded.observe(record.padded_size)
        self.batch_close.labels(record.reason).inc()
        self.queue_wait.observe(record.queue_wait_s)
        self.batch_run.observe(record.run_s)
        if not record.ok:
            self.rejects.labels("batch_failed").inc()
        if record.isolated:
            self.isolations.inc(record.isolated)
        if record.positions:
            self._real_positions.inc(record.positions)
            self._pad_positions.inc(record.padded_positions)

    def bind_gauges(
        self,
        queue_rows: Callable[[], float],
        inflight: Callable[[], float],
        effective_wait: Callable[[], float],
    ) -> None:
        self.queue_rows.set_function(queue_rows)
        self.inflight.set_function(inflight)
        self.effective_wait.set_function(effective_wait)

    def bind_health(self, source: Callable[[], Health]) -> None:
        self.health.source = source

    def set_stage_stats(self, rows: Iterable[dict[str, Any]]) -> None:
        self.stages.snapshot = list(rows)

    def render(self) -> bytes:
        return generate_latest(self.registry)
