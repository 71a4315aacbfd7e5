"""Every background task of the server starts here, so that none ends unseen (through
``serving.supervisor``, which the batcher's loop shares, counted in the server's metrics).

A task that raises has its traceback logged once, is counted in
``shardserve_background_errors_total{task}``, and then:

- a loop (the stats poll, the scaling loop, the repository's poll) is started again after a
  pause that doubles while it keeps failing (``RESTART_S``), as a controller retries a failed
  step on its next tick: a bug in one tick no longer ends that loop for the life of the server;
- a one-shot task (a version's load, a switch's settle) is not run again: ``on_failure`` gets
  the reason in one line, and marks the version it belongs to unhealthy with it.

A cancelled task (a stop, an unload) ends quietly: that is how the server ends them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serving.metrics.series import Metrics
from serving.supervisor import Job, start_supervised

__all__ = ["RESTART_S", "supervise"]

# The pause before a failed loop starts again, doubling up to the second figure; a loop that ran
# longer than that before failing starts from the first again.
RESTART_S = (1.0, 60.0)


def supervise(
    task: str,
    job: Job,
    metrics: Metrics,
    *,
    what: str,
    restart: bool = True,
    on_failure: Callable[[str], None] | None = None,
) -> asyncio.Task[None]:
    """Run ``job()`` as a task named ``shardserve-<task>``: ``task`` is the counter's label,
    ``what`` names it in the log (``model 'a' version 2's scaling loop``). With ``restart``,
    a failure runs ``job()`` again after a pause; without, it calls ``on_failure(reason)``."""
    return start_supervised(
        task, job, what=what, on_error=metrics.background_error,
        pause=RESTART_S if restart else None, on_failure=on_failure,
    )  # fmt: skip
