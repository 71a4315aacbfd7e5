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

``RepeatedFailures`` is the same rule for a step that a controller takes again and again (the
reconciler's step of a model, an operation of it, a canary's judge): the first failure is logged
with its traceback; the same failure again is counted, and said in one WARNING line with the
count at most every ``SUMMARY_S``; the step is taken again after a pause that doubles from
``RESTART_S[0]`` to ``RESTART_S[1]``; its first success after failures is said once. A step that
failed for ever logged a traceback every second per model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "RESTART_S",
    "SUMMARY_S",
    "ErrorCounter",
    "Job",
    "RepeatedFailures",
    "run_supervised",
    "start_supervised",
    "supervise",
]

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


# A step that keeps failing the same way is said at most this often (with its count).
SUMMARY_S = 60.0


@dataclass
class _Failing:
    error: str  # the type and first line: a different error is logged with its traceback
    count: int  # failures since the first, or since the last line that said them
    total: int
    since: float
    said: float  # when a line last said it
    pause: float
    next_try: float


class RepeatedFailures:
    """The failures of steps taken again and again, by key (see the module's docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failing: dict[Hashable, _Failing] = {}

    def wait_s(self, key: Hashable) -> float:
        """Seconds before the step of ``key`` may be taken again (0: now)."""
        failing = self._failing.get(key)
        return 0.0 if failing is None else max(0.0, failing.next_try - self._clock())

    def failed(self, key: Hashable, what: str, exc: BaseException) -> None:
        now = self._clock()
        error = f"{type(exc).__name__}: {_first_line(exc)}"
        failing = self._failing.get(key)
        if failing is None or failing.error != error:
            log.error("%s failed (%s)", what, error, exc_info=exc)
            pause = RESTART_S[0]
            self._failing[key] = _Failing(error, 0, 1, now, now, pause, now + pause)
            return
        failing.count += 1
        failing.total += 1
        failing.pause = min(failing.pause * 2, RESTART_S[1])
        failing.next_try = now + failing.pause
        if now - failing.said >= SUMMARY_S:
            log.warning(
                "%s failed again (%s): %d more times in the last %.0f s, %d since it began "
                "%.0f s ago; taken again every %g s",
                what,
                error,
                failing.count,
                now - failing.said,
                failing.total,
                now - failing.since,
                failing.pause,
            )
            failing.count, failing.said = 0, now

    def succeeded(self, key: Hashable, what: str) -> None:
        failing = self._failing.pop(key, None)
        if failing is not None:
            log.info(
                "%s succeeded after %d failure%s in %.0f s",
                what,
                failing.total,
                "" if failing.total == 1 else "s",
                self._clock() - failing.since,
            )


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
