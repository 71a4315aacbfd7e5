"""Prometheus metrics of one server. Each app gets its own registry (tests build many apps).

Every series is one served version's (labels ``model``, ``version``): ``Metrics.for_model``
hands a ``ServedModel`` its ``ModelMetrics``, and ``Metrics.remove_model`` drops them on unload.
One is the server's own: ``shardserve_background_errors_total{task}`` (``supervise``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from serving.metrics.scraped import (
    MODEL_LABELS,
    HealthCollector,
    ModelKey,
    StageCollector,
    memory_figures,
)
from serving.telemetry.batch_record import BatchRecord
from shards.pipeline.health import Health

__all__ = [
    "BACKGROUND_TASKS",
    "MODEL_LABELS",
    "STREAM_OUTCOMES",
    "GenerationMetrics",
    "Metrics",
    "ModelMetrics",
    "memory_figures",
]

# The background tasks (``serving.supervisor``), by the label their failures are counted in.
BACKGROUND_TASKS = (
    "load",
    "batcher",
    "load_waits",
    "stats_poll",
    "scaling",
    "scale_up",
    "scale_down",
    "recovery",
    "repository_poll",
    "rollout_watch",
    "settle",
    "hand_over",
)
# How a streamed generation ended (``shardserve_generation_streams_total{outcome}``).
STREAM_OUTCOMES = ("done", "length", "stop", "cancelled", "deadline", "error")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Families:
    """The server's labelled series; each served version owns the children of its labels."""

    def __init__(self, r: CollectorRegistry) -> None:
        labels = MODEL_LABELS
        self.request_latency = Histogram(
            "shardserve_request_latency_seconds",
            "Time from request received to response ready",
            [*labels, "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejects = Counter(
            "shardserve_rejects_total",
            "Requests refused or failed, by reason",
            [*labels, "reason"],
            registry=r,
        )
        self.batch_size = Histogram(
            "shardserve_batch_size_rows",
            "Real rows per batch",
            labels,
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.batch_padded = Histogram(
            "shardserve_batch_padded_size_rows",
            "Rows per batch after padding",
            labels,
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.positions = Counter(
            "shardserve_padded_positions",
            "Positions of length-padded batches: real (the rows' own lengths) or pad (added to "
            "reach the batch's length bucket: the waste)",
            [*labels, "kind"],
            registry=r,
        )
        self.batch_close = Counter(
            "shardserve_batch_close_total",
            "Batches by close reason",
            [*labels, "reason"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "shardserve_queue_wait_seconds",
            "Wait of a batch's oldest row before dispatch",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_run = Histogram(
            "shardserve_batch_run_seconds",
            "Time of a batch through the pipeline",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_rows = Gauge(
            "shardserve_queue_rows", "Rows waiting in the queue", labels, registry=r
        )
        self.inflight = Gauge(
            "shardserve_inflight_batches", "Batches in the pipeline", labels, registry=r
        )
        self.effective_wait = Gauge(
            "shardserve_batch_wait_ms", "Current wait of the batching policy", labels, registry=r
        )
        self.held_rows = Gauge(
            "shardserve_held_rows",
            "Rows of lost batches held for the model's replica to be back (not in queue_rows)",
            labels,
            registry=r,
        )
        self.isolations = Counter(
            "shardserve_poison_isolations_total",
            "Requests failed alone after their batch was split to find the rows the model "
            "raises on (their batch-mates were answered)",
            labels,
            registry=r,
        )
        self.rollbacks = Counter(
            "shardserve_rollbacks_total",
            "Canaries rolled back, by reason: errors, latency (the judge) or manual (the API)",
            [*labels, "reason"],
            registry=r,
        )

        self.scale_events = Counter(
            "shardserve_scale_events_total",
            "Replicas added (direction up) or removed (down) by the autoscaler, by reason",
            [*labels, "direction", "reason"],
            registry=r,
        )

        # A generating version's (serving.generation): its scheduler's steps and tokens.
        self.first_token = Histogram(
            "shardserve_time_to_first_token_seconds",
            "Time from a prompt's arrival to its first generated token, by priority level",
            [*labels, "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_wait = Histogram(
            "shardserve_generation_queue_wait_seconds",
            "Time from a prompt's arrival to its first KV slot, by priority level",
            [*labels, "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "shardserve_generation_preemptions",
            "Running sequences that gave their slot to a higher-priority prompt (prefilled "
            "again later), by their priority level",
            [*labels, "priority"],
            registry=r,
        )
        self.refusals = Counter(
            "shardserve_generation_refusals",
            "Prompts refused (503) because their priority level's queue was full, by level",
            [*labels, "priority"],
            registry=r,
        )
        self.token_gap = Histogram(
            "shardserve_time_per_output_token_seconds",
            "Time between a sequence's generated tokens after its first",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated = Counter(
            "shardserve_generated_tokens",
            "Tokens generated (answered or not)",
            labels,
            registry=r,
        )
        self.running_sequences = Gauge(
            "shardserve_running_sequences",
            "Sequences generating now (each holds a KV slot)",
            labels,
            registry=r,
        )
        self.waiting_prompts = Gauge(
            "shardserve_waiting_prompts",
            "Prompts of a generating model waiting for a slot (preempted sequences among "
            "them), by priority level",
            [*labels, "priority"],
            registry=r,
        )
        self.free_kv_slots = Gauge(
            "shardserve_free_kv_slots",
            "KV cache slots free, over every replica",
            labels,
            registry=r,
        )
        self.step_rows = Histogram(
            "shardserve_generation_step_rows",
            "Rows (sequences) per generation step",
            labels,
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.streams = Counter(
            "shardserve_generation_streams",
            "Streamed generations by how they ended: length or stop (every choice's finish "
            "reason), done (choices that ended for different ones), cancelled (the client "
            "left), deadline, error",
            [*labels, "outcome"],
            registry=r,
        )
        self.steps = Counter(
            "shardserve_generation_steps",
            "Generation steps by kind: prefill (it held a prompt) or decode",
            [*labels, "kind"],
            registry=r,
        )

    def all(self) -> tuple[Counter | Gauge | Histogram, ...]:
        return tuple(v for v in vars(self).values() if isinstance(v, Counter | Gauge | Histogram))


class ModelMetrics:
    """One served version's series (labels ``model``, ``version``): what its ``ServedModel``,
    batcher and routes count. After ``Metrics.remove_model`` it counts nothing: a request still
    draining must not bring the version's series back."""

    def __init__(
        self, families: _Families, stages: StageCollector, health: HealthCollector, key: ModelKey
    ) -> None:
        self.key = key
        self.removed = False
        self._f = families
        self._stages = stages
        self._health = health
        # Children by label, taken once: ``labels()`` costs a lock and a dict of label values
        # on every call, and latency and rejects are on every request's path.
        self._latency_by_status: dict[int, Any] = {}
        self._rejects_by_reason: dict[str, Any] = {}
        self._close_by_reason: dict[str, Any] = {}
        # Called with every answered request's status and seconds (the autoscaler's demand).
        self._listeners: list[Callable[[int, float], None]] = []
        # Called with the outcome of each request the server chose this version for (a
        # canary's judge): whether the version failed it, and its seconds.
        self._routed_listeners: list[Callable[[bool, float], None]] = []
        # Every series without a label of its own exists from the start: a rate reads 0, not
        # absent, before the first batch (and before any length-padded one).
        self._batch_size = families.batch_size.labels(*key)
        self._batch_padded = families.batch_padded.labels(*key)
        self._queue_wait = families.queue_wait.labels(*key)
        self._batch_run = families.batch_run.labels(*key)
        self._isolations = families.isolations.labels(*key)
        self._real_positions = families.positions.labels(*key, "real")
        self._pad_positions = families.positions.labels(*key, "pad")
        self._gauges = (
            families.queue_rows.labels(*key),
            families.inflight.labels(*key),
            families.effective_wait.labels(*key),
        )
        self._held_rows = families.held_rows.labels(*key)

    def add_listener(self, listener: Callable[[int, float], None]) -> None:
        """``listener(status, seconds)`` after every answered request, whatever the protocol."""
        self._listeners.append(listener)

    def add_routed_listener(self, listener: Callable[[bool, float], None]) -> None:
        """``listener(failed, seconds)`` after each ``observe_routed``."""
        self._routed_listeners.append(listener)

    def observe_routed(self, failed: bool, seconds: float) -> None:
        for listener in self._routed_listeners:
            listener(failed, seconds)

    def observe_latency(self, status: int, seconds: float, trace_id: str | None = None) -> None:
        """``trace_id``: the request's sampled trace, kept as its bucket's exemplar (shown to a
        scraper that asks for OpenMetrics: ``render``)."""
        for listener in self._listeners:
            listener(status, seconds)
        child = self._latency_by_status.get(status)
        if child is None:
            if self.removed:
                return
            child = self._latency_by_status[status] = self._f.request_latency.labels(
                *self.key, str(status)
            )
        if trace_id is None:
            child.observe(seconds)
        else:
            child.observe(seconds, {"trace_id": trace_id})

    def rollback(self, reason: str) -> None:
        if not self.removed:
            self._f.rollbacks.labels(*self.key, reason).inc()

    def reject(self, reason: str) -> None:
        child = self._rejects_by_reason.get(reason)
        if child is None:
            if self.removed:
                return
            child = self._rejects_by_reason[reason] = self._f.rejects.labels(*self.key, reason)
        child.inc()

    def observe_batch(self, record: BatchRecord) -> None:
        if self.removed:
            return
        self._batch_size.observe(record.size)
        self._batch_padded.observe(record.padded_size)
        close = self._close_by_reason.get(record.reason)
        if close is None:
            close = self._close_by_reason[record.reason] = self._f.batch_close.labels(
                *self.key, record.reason
            )
        close.inc()
        self._queue_wait.observe(record.queue_wait_s)
        self._batch_run.observe(record.run_s)
        if not record.ok:
            self.reject("batch_failed")
        if record.isolated:
            self._isolations.inc(record.isolated)
        if record.positions:
            self._real_positions.inc(record.positions)
            self._pad_positions.inc(record.padded_positions)

    def bind_gauges(
        self,
        queue_rows: Callable[[], float],
        inflight: Callable[[], float],
        effective_wait: Callable[[], float],
        held_rows: Callable[[], float] | None = None,
    ) -> None:
        for gauge, source in zip(self._gauges, (queue_rows, inflight, effective_wait), strict=True):
            gauge.set_function(source)
        if held_rows is not None:
            self._held_rows.set_function(held_rows)

    def generation(self) -> GenerationMetrics:
        """What a generating version's scheduler observes (``GenerationObserver``)."""
        return GenerationMetrics(self, self._f, self.key)

    def bind_generation(
        self,
        running: Callable[[], float],
        free_slots: Callable[[], float],
        waiting: dict[str, Callable[[], float]] | None = None,
    ) -> None:
        """``waiting``: each priority level's queue length."""
        if not self.removed:
            self._f.running_sequences.labels(*self.key).set_function(running)
            self._f.free_kv_slots.labels(*self.key).set_function(free_slots)
            for level, source in (waiting or {}).items():
                self._f.waiting_prompts.labels(*self.key, level).set_function(source)

    def scale_event(self, direction: str, reason: str) -> None:
        if not self.removed:
            self._f.scale_events.labels(*self.key, direction, reason).inc()

    def bind_state(self, state: Callable[[], str], states: tuple[str, ...]) -> None:
        """``shardserve_version_state`` reads ``state()`` at each scrape (one of ``states``)."""
        if not self.removed:
            self._health.states[self.key] = (state, states)

    def bind_health(self, source: Callable[[], Health]) -> None:
        if not self.removed:
            self._health.sources[self.key] = source

    def set_stage_stats(self, rows: Iterable[dict[str, Any]]) -> None:
        if not self.removed:
            self._stages.snapshots[self.key] = list(rows)


class GenerationMetrics:
    """A generating version's scheduler's series (``serving.generation.GenerationObserver``)."""

    def __init__(self, model: ModelMetrics, families: _Families, key: ModelKey) -> None:
        self._model = model
        self._key = key
        self._families = families
        self._first: dict[str, Any] = {}
        self._prompt_wait: dict[str, Any] = {}
        self._preemptions: dict[str, Any] = {}
        self._refusals: dict[str, Any] = {}
        self._gap = families.token_gap.labels(*key)
        self._tokens = families.generated.labels(*key)
        self._rows = families.step_rows.labels(*key)
        self._steps = {kind: families.steps.labels(*key, kind) for kind in ("prefill", "decode")}
        self._streams = {o: families.streams.labels(*key, o) for o in STREAM_OUTCOMES}

    def observe_step(self, kind: str, rows: int) -> None:
        if not self._model.removed:
            self._steps[kind].inc()
            self._rows.observe(rows)

    def _child(self, children: dict[str, Any], family: Any, priority: str) -> Any:
        child = children.get(priority)
        if child is None:
            child = children[priority] = family.labels(*self._key, priority)
        return child

    def observe_first_token(self, seconds: float, priority: str) -> None:
        if not self._model.removed:
            self._child(self._first, self._families.first_token, priority).observe(seconds)

    def observe_queue_wait(self, seconds: float, priority: str) -> None:
        if not self._model.removed:
            self._child(self._prompt_wait, self._families.prompt_wait, priority).observe(seconds)

    def observe_preemption(self, priority: str) -> None:
        if not self._model.removed:
            self._child(self._preemptions, self._families.preemptions, priority).inc()

    def observe_refusal(self, priority: str) -> None:
        if not self._model.removed:
            self._child(self._refusals, self._families.refusals, priority).inc()
            self._model.reject("queue_full")  # as the data plane's refusal from the headers

    def observe_token_gap(self, seconds: float) -> None:
        if not self._model.removed:
            self._gap.observe(seconds)

    def observe_tokens(self, count: int) -> None:
        if not self._model.removed:
            self._tokens.inc(count)

    def observe_stream(self, outcome: str) -> None:
        if not self._model.removed:
            self._streams[outcome].inc()


class Metrics:
    """The server's registry: one ``ModelMetrics`` per served version (``for_model``), whose
    series go with it on unload (``remove_model``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._families = _Families(self.registry)
        self._stages = StageCollector()
        self.registry.register(self._stages)  # type: ignore[arg-type]
        self._health = HealthCollector()
        self.registry.register(self._health)  # type: ignore[arg-type]
        self._models: dict[ModelKey, ModelMetrics] = {}
        # The server's own, not a version's: every label exists from the start (a rate reads 0).
        self._background_errors = Counter(
            "shardserve_background_errors_total",
            "Background tasks that raised (logged with the traceback; a loop started again, a "
            "one-shot task's version marked unavailable), by task",
            ["task"],
            registry=self.registry,
        )
        for task in BACKGROUND_TASKS:
            self._background_errors.labels(task)

    def background_error(self, task: str) -> None:
        """One failure of the background task ``task`` (``serving.supervisor``)."""
        self._background_errors.labels(task).inc()

    def for_model(self, name: str, version: str) -> ModelMetrics:
        """The series of ``name`` at ``version`` (the same object on every call until removed)."""
        key = (name, str(version))
        found = self._models.get(key)
        if found is None:
            found = self._models[key] = ModelMetrics(
                self._families, self._stages, self._health, key
            )
        return found

    def remove_model(self, name: str, version: str) -> None:
        """Drop every series of ``name`` at ``version`` (its unload): a scrape no longer shows
        it, and its gauges no longer hold its batcher or runner."""
        key = (name, str(version))
        model = self._models.pop(key, None)
        if model is not None:
            model.removed = True
        for family in self._families.all():
            family.remove_by_labels(dict(zip(MODEL_LABELS, key, strict=True)))
        self._stages.snapshots.pop(key, None)
        self._health.sources.pop(key, None)
        self._health.states.pop(key, None)

    def render(self, openmetrics: bool = False) -> bytes:
        """The exposition: Prometheus' text format, or OpenMetrics (the only one that carries
        the latency buckets' exemplars: a slow bucket's trace) where the scraper asks for it."""
        if openmetrics:
            return openmetrics_latest(self.registry)
        return generate_latest(self.registry)
