"""How every background task of shardserve runs, so that none ends unseen.

It sits at the bottom of ``serving`` (beside the settings and errors) so that every layer starts
its tasks through it: the batcher's loop as well as the server's (``supervise``: a version's jobs,
the reconciler's operations). It imports no metrics: the caller hands it ``on_error(task)`` (or
the metrics themselves, as an ``ErrorCounter``), which counts the failure (the server's
``shardserve_background_errors_total{task}``).

A task that raises has its traceback logged once, ``on_error(task)`` called, and then:

- with ``pause`` (a loop), it is started again after a pause that doubles from ``pause[0]`` up
  to ``pause[1]`` while it keeps failing, as a controller retries a failed step on its next
  tick; with ``give_up=(n, window_s)``, a failure that makes more than ``n`` within
  ``window_s`` ends it instead (a loop that keeps crashing has a bug restarts cannot fix);
- without (a one-shot task), or once given up, ``on_failure`` gets the reason in one line and
  marks what the task belongs to unhealthy with it.

A cancelled task (a stop, an unload) ends quietly: that is how its owner ends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

__all__ = ["RESTART_S", "ErrorCounter", "Job", "run_supervised", "start_supervised", "supervise"]

log = logging.getLogger("shardserve")

Job = Callable[[], Coroutine[Any, Any, None]]


def start_supervised(
    task: str,
    job: Job,
    *,
    what: str,
    on_error: Callable[[str], None] | None = None,
    pause: tuple[float, float] | None = None,
    give_up: tuple[int, float] | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> asyncio.Task[None]:
    """Run ``job()`` as a task named ``shardserve-<task>``: ``task`` is the counter's label,
    ``what`` names it in the log (``model 'a' version 2's scaling loop``)."""
    return asyncio.create_task(
        run_supervised(
            task, job, what=what, on_error=on_error, pause=pause, give_up=give_up,
            on_failure=on_failure,
        ),
        name=f"shardserve-{task}",
    )  # fmt: skip


async def run_supervised(
    task: str,
    job: Job,
    *,
    what: str,
    on_error: Callable[[str], None] | None = None,
    pause: tuple[float, float] | None = None,
    give_up: tuple[int, float] | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> None:
    """``start_supervised`` in the caller's own task (one that must be that task, e.g. one a
    scale-down cancels)."""
    wait = pause[0] if pause is not None else 0.0
    failures: list[float] = []
    while True:
        started = time.monotonic()
        try:
            await job()
            return
        except Exception as exc:
            now = time.monotonic()
            if on_error is not None:
                try:
                    on_error(task)
                except Exception:
                    log.exception("counting a failure of %s failed", what)
            reason = f"{what} failed ({type(exc).__name__}: {_first_line(exc)})"
            if give_up is not None:
                failures = [t for t in failures if now - t < give_up[1]]
                failures.append(now)
            if give_up is not None and len(failures) > give_up[0]:
                reason += f"; {len(failures)} failures in {give_up[1]:g} s, not started again"
                pause = None
            if pause is None:
                log.exception("%s", reason)
                if on_failure is not None:
                    on_failure(f"{reason}; the server log has the traceback")
                return
            if now - started > pause[1]:
                wait = pause[0]
            log.exception("%s; starting it again in %g s", reason, wait)
        await asyncio.sleep(wait)  # even with none: a job that raises at once must not spin
        wait = min(wait * 2, pause[1])


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


# The pause before a failed loop of the server starts again, doubling up to the second figure; a
# loop that ran longer than that before failing starts from the first again.
RESTART_S = (1.0, 60.0)


class ErrorCounter(Protocol):
    """What counts a background task's failure (``serving.metrics.series.Metrics``)."""

    def background_error(self, task: str) -> None: ...


def supervise(
    task: str,
    job: Job,
    metrics: ErrorCounter,
    *,
    what: str,
    restart: bool = True,
    on_failure: Callable[[str], None] | None = None,
) -> asyncio.Task[None]:
    """Run ``job()`` as a task named ``shardserve-<task>``: ``task`` is the counter's label,
    ``what`` names it in the log (``model 'a' version 2's scaling loop``). With ``restart``,
    a failure runs ``job()`` again after ``RESTART_S``; without, it calls ``on_failure(reason)``."""
    return start_supervised(
        task, job, what=what, on_error=metrics.background_error,
        pause=RESTART_S if restart else None, on_failure=on_failure,
    )  # fmt: skip
