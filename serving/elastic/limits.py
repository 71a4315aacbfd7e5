"""The batching limits of a version whose replica count changes: they follow its healthy replicas.

A version's batcher starts with limits sized for the replicas it started with (in-flight batches,
queue rows, pipeline depth: ``serving.version.served.batch_settings``). When replicas come and go
(a scale step, a version switch replica by replica) the limits become those a start with that
many healthy replicas would have had, so a new replica gets batches to run and a removed one's
share is not queued for the rest. A limit the operator set (a flag, or an admin PUT since) is
theirs: it is left as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.settings.config import default_queue_rows

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.version.served import ServedModel

__all__ = ["BatchLimits"]


class BatchLimits:
    """One version's batching limits, following its healthy replicas (``follow``)."""

    def __init__(self, model: ServedModel, batcher: Batcher, stages: int) -> None:
        self.model, self.batcher, self.stages = model, batcher, stages
        self.settings = model.settings
        # The batcher's in-flight limit as last set here: one that differs was changed by the
        # operator (an admin PUT), and is theirs from then on.
        self._inflight_set = batcher.settings.max_inflight_batches
        self._start_rows = batcher.settings.max_queue_rows

    def follow(self, healthy: int) -> None:
        """The batcher's in-flight batches, queue rows and pipeline depth for ``healthy``
        replicas, as at start-up for that many, except those the operator set (a flag, or an
        admin PUT since); the queue never shrinks below its start-up rows (a request that size
        was served)."""
        n, policy, settings = max(1, healthy), self.batcher.settings, self.settings
        inflight = policy.max_inflight_batches
        if settings.max_inflight_batches is None and inflight == self._inflight_set:
            inflight = settings.inflight_batches(self.stages, n)
        wanted: dict[str, int] = {
            "pipeline_depth": self.stages * n,
            "max_inflight_batches": inflight,
        }
        if settings.max_queue_rows is None:
            rows = default_queue_rows(policy.max_batch_size, inflight)
            wanted["max_queue_rows"] = max(rows, self._start_rows) * self.model.queue_factor
        changes = {k: v for k, v in wanted.items() if getattr(policy, k) != v}
        if changes:
            self.batcher.reconfigure(**changes)
            self._inflight_set = inflight
