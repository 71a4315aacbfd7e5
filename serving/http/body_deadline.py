"""The body-read deadline (``body_read_timeout_s``): a client that trickles its body holds a
connection and a buffer, and on a predict route its model's admission, which a drain waits for;
so a read that outlasts its deadline ends in a 408 (``serving.http.replies.read_body``). The
same ``Deadlines`` times the heads of requests (``serving.http.protocol``).

uvicorn has no such timeout: its keep-alive timer stops at the request's first byte. One timer
per event loop watches every read in progress, rather than one per request: an
``asyncio.timeout`` around each read (a timer handle made and cancelled per request) added
6-9 us to a request on 2 idle cores (16-29 us loaded), the deadline kept here 2 us loaded. A
read registers its task and deadline (a dict insert) and leaves (a dict pop); the timer fires at
the earliest deadline, cancels the reads past theirs, and re-arms for the next one while any
are left.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["BodyDeadlines", "Deadlines", "body_deadlines"]

K = TypeVar("K")

# A timer may fire a little before its time (the loop's clock, its resolution): a wait this
# close to its deadline is past it, rather than the timer re-armed for a moment.
_SLACK_S = 0.001


class Deadlines(Generic[K]):
    """Things waiting on one event loop, each until its deadline, watched by one timer that
    calls ``expire(thing)`` for each one past its deadline (and forgets it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, expire: Callable[[K], None]) -> None:
        self.loop = loop
        self._expire = expire
        self._waiting: dict[K, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def start(self, key: K, timeout_s: float) -> None:
        """``key`` waits from now, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._waiting[key] = deadline
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._arm(deadline)

    def end(self, key: K) -> None:
        """``key`` waits no more (a no-op for one that never waited, or expired)."""
        self._waiting.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def _arm(self, at: float) -> None:
        self._timer_at = at
        self._timer = self.loop.call_later(max(0.0, at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = time.monotonic() + _SLACK_S
        following = math.inf
        for key, deadline in list(self._waiting.items()):
            if deadline <= now:
                del self._waiting[key]
                self._expire(key)
            elif deadline < following:
                following = deadline
        if following < math.inf:
            self._arm(following)


class BodyDeadlines(Deadlines[asyncio.Task[Any]]):
    """The body reads in progress on one event loop: a read past its deadline has its task
    cancelled, which ``read_body`` turns into a 408 (``expired``); the server's stop cuts
    those left at its drain mark (``cut_all``), a 503 (``cut``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop, self._cancel)
        self._expired: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()

    def end(self, key: asyncio.Task[Any]) -> None:
        self._waiting.pop(key, None)  # Deadlines.end, inlined: once per request
        if self._expired:
            self._expired.discard(key)
        if self._cut:
            self._cut.discard(key)

    def cut_all(self) -> int:
        """Cancel every read in progress (the server is stopping); how many there were."""
        tasks = list(self._waiting)
        self._waiting.clear()
        for task in tasks:
            self._cut.add(task)
            task.cancel()
        return len(tasks)

    def cut(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task`` was cancelled by ``cut_all`` (once: it is forgotten)."""
        if task in self._cut:
            self._cut.discard(task)
            return True
        return False

    def expired(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task`` was cancelled here, its deadline passed (once: it is forgotten)."""
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self._expired.add(task)
        task.cancel()


# One per thread (a loop runs in one thread; a test client may run another loop in its own):
# the timer and the tasks it cancels must be the running loop's.
_local = threading.local()


def body_deadlines() -> BodyDeadlines:
    """The running loop's ``BodyDeadlines``."""
    loop = asyncio.get_running_loop()
    current: BodyDeadlines | None = getattr(_local, "current", None)
    if current is None or current.loop is not loop:
        current = _local.current = BodyDeadlines(loop)
    return current
