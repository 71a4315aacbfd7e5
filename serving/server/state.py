"""What one server holds while it runs: settings, metrics, the runner and the batcher."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from serving.batching.batcher import Batcher, BatchSettings
from serving.config import Settings
from serving.errors import NotReadyError
from serving.server.metrics import Metrics
from serving.server.runner import ModelRunner
from serving.server.stop_budget import StopBudget

log = logging.getLogger("shardserve")
RunnerFactory = Callable[[Settings], Awaitable[ModelRunner]]


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
    # While loading: what the load waits for (resources Ray has not granted yet), for /readyz.
    load_waiting: str | None = None
    # Set when the server starts stopping: every phase of the stop shares this one deadline.
    stop_budget: StopBudget | None = None

    @property
    def batcher_failure(self) -> str | None:
        """Why the batcher stopped serving on its own (its loop kept crashing), if it did."""
        return self.batcher.failure if self.batcher is not None else None

    def begin_stop(self) -> StopBudget:
        """Refuse new requests from now on; the stop's budget (``stop_timeout_s``), started by
        the first caller and shared by the later ones."""
        self.accepting = False
        if self.stop_budget is None:
            self.stop_budget = StopBudget.start(self.settings.stop_timeout_s)
        return self.stop_budget

    def require_batcher(self) -> Batcher:
        if self.load_error:
            raise NotReadyError(f"model failed to load: {self.load_error}")
        if self.batcher is None or not self.ready.is_set():
            waiting = f" ({self.load_waiting})" if self.load_waiting else ""
            raise NotReadyError(
                f"model is still loading{waiting}; retry when GET /readyz answers 200"
            )
        if not self.accepting:
            raise NotReadyError("server is shutting down")
        if self.batcher.failure is not None:
            raise NotReadyError(self.batcher.failure)
        return self.batcher


def policy_from_settings(settings: Settings, runner: ModelRunner) -> BatchSettings:
    stages, replicas = runner.num_stages, runner.replicas
    return BatchSettings(
        max_batch_size=settings.max_batch_size,
        batch_timeout_ms=None if settings.timeout_is_auto else float(settings.batch_timeout_ms),
        max_inflight_batches=settings.inflight_batches(stages, replicas),
        max_queue_rows=settings.queue_rows(stages, replicas),
        allowed_batch_sizes=settings.batch_sizes(),
        slo_p99_ms=settings.slo_p99_ms,
        pipeline_depth=stages * replicas,
        # CPU stages take any batch size with one trace: padding would only add rows.
        pad_batches=settings.allowed_batch_sizes is not None or runner.on_gpu,
    )
