"""Every background task of the server starts here, so that none ends unseen.

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
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from serving.server.metrics import Metrics

__all__ = ["RESTART_S", "supervise"]

log = logging.getLogger("shardserve")

# The pause before a failed loop starts again, doubling up to the second figure; a loop that ran
# longer than that before failing starts from the first again.
RESTART_S = (1.0, 60.0)

Job = Callable[[], Coroutine[Any, Any, None]]


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
    return asyncio.create_task(
        _run(task, job, metrics, what, restart, on_failure), name=f"shardserve-{task}"
    )


async def _run(
    task: str,
    job: Job,
    metrics: Metrics,
    what: str,
    restart: bool,
    on_failure: Callable[[str], None] | None,
) -> None:
    pause = RESTART_S[0]
    while True:
        started = time.monotonic()
        try:
            await job()
            return
        except Exception as exc:
            metrics.background_error(task)
            reason = f"{what} failed ({type(exc).__name__}: {_first_line(exc)})"
            if not restart:
                log.exception("%s", reason)
                if on_failure is not None:
                    on_failure(f"{reason}; the server log has the traceback")
                return
            if time.monotonic() - started > RESTART_S[1]:
                pause = RESTART_S[0]
            log.exception("%s; starting it again in %g s", reason, pause)
        await asyncio.sleep(pause)
        pause = min(pause * 2, RESTART_S[1])


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"
