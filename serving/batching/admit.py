"""Whether a request's rows may join the queue now (``Batcher.submit``): room under
``max_queue_rows``, a deadline not passed yet, and, while the model's replica is brought back
(``serving.batching.hold``), one that falls after it is expected back. Each refusal comes with the
reason the metrics count it under."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from serving.errors import DeadlineExceededError, QueueFullError, ShardServeError

if TYPE_CHECKING:
    from serving.batching.cost import RunTimeModel
    from serving.batching.hold import Hold
    from serving.batching.settings import BatchSettings


def refusal(
    queued: int,
    rows: int,
    deadline: float | None,
    policy: BatchSettings,
    runtime: RunTimeModel,
    hold: Hold,
) -> tuple[str, ShardServeError] | None:
    """(reason, the error) for ``rows`` more rows behind ``queued``; None when they may queue."""
    if queued + rows > policy.max_queue_rows:
        return "queue_full", QueueFullError(
            f"queue full: {queued} rows queued, {rows} more would pass "
            f"max_queue_rows={policy.max_queue_rows}",
            retry_after_s=runtime.retry_after_s(queued + rows, policy.max_batch_size),
        )
    if deadline is not None and deadline <= time.monotonic():
        return "deadline", DeadlineExceededError(
            "the request's deadline passed before it was queued"
        )
    too_late = hold.cannot_wait(deadline)
    return ("recovering", too_late) if too_late is not None else None
