"""What one server holds while it runs, and the lifespan's jobs: load, warm up, poll stats."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from serving.batcher import Batcher, BatchingPolicy
from serving.config import Settings
from serving.errors import NotReadyError
from serving.metrics import Metrics
from serving.runner import ModelRunner
from shards.errors import one_line

log = logging.getLogger("shardserve")
RunnerFactory = Callable[[Settings], Awaitable[ModelRunner]]
STATS_PERIOD_S = 5.0


@dataclass
class ServerState:
    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    runner: ModelRunner | None = None
    batcher: Batcher | None = None
    load_error: str | None = None
    accepting: bool = False
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    loaded: asyncio.Event = field(default_factory=asyncio.Event)

    def require_batcher(self) -> Batcher:
        if self.load_error:
            raise NotReadyError(f"model failed to load: {self.load_error}")
        if self.batcher is None or not self.ready.is_set():
            raise NotReadyError("model is still loading; retry when GET /readyz answers 200")
        if not self.accepting:
            raise NotReadyError("server is shutting down")
        return self.batcher


def policy_from_settings(settings: Settings, runner: ModelRunner) -> BatchingPolicy:
    stages, replicas = runner.num_stages, runner.replicas
    return BatchingPolicy(
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=None if settings.timeout_is_auto else float(settings.batch_timeout_ms),
        max_inflight_batches=settings.inflight_batches(stages, replicas),
        max_queue_rows=settings.queue_rows(stages, replicas),
        allowed_batch_sizes=settings.batch_sizes(),
        slo_p99_ms=settings.slo_p99_ms,
        pipeline_depth=stages * replicas,
    )


def describe_error(exc: BaseException) -> str:
    """One line for clients: the root cause of a remote (Ray) error, never its traceback."""
    cause = getattr(exc, "cause", None)
    return one_line(cause if isinstance(cause, BaseException) else exc)


async def load_model(
    state: ServerState, factory: RunnerFactory, on_failure: Callable[[str], None] | None
) -> None:
    try:
        runner = await factory(state.settings)
        state.runner = runner
        state.loaded.set()
        batcher = Batcher(
            runner.run_batch,
            policy_from_settings(state.settings, runner),
            on_batch=state.metrics.observe_batch,
            on_reject=lambda reason: state.metrics.rejects.labels(reason).inc(),
        )
        await batcher.start()
        state.metrics.bind_gauges(
            lambda: batcher.queued_rows,
            lambda: batcher.inflight_batches,
            lambda: batcher.effective_wait_ms,
        )
        state.metrics.bind_health(runner.health)
        await _warm_up(runner)
        state.batcher = batcher
        state.accepting = True
        state.ready.set()
        log.info("ready: serving %r (%d stage(s))", state.settings.served_name(), runner.num_stages)
    except Exception as exc:  # any failure becomes a clear /readyz message, never a hang
        state.load_error = describe_error(exc)
        log.exception("model failed to load")
        state.loaded.set()
        if on_failure is not None:
            on_failure(state.load_error)


async def _warm_up(runner: ModelRunner) -> None:
    """One batch end to end, so the first user request does not pay for connection set-up."""
    inputs = {
        spec.name: np.zeros((1, *(d or 1 for d in spec.shape)), dtype=spec.np_dtype)
        for spec in runner.signature.inputs
    }
    await runner.run_batch(inputs)


async def poll_stage_stats(state: ServerState) -> None:
    while True:
        runner = state.runner
        if runner is not None:
            with contextlib.suppress(Exception):
                state.metrics.set_stage_stats(await runner.stats())
        await asyncio.sleep(STATS_PERIOD_S)
