"""The body-read deadline (``body_read_timeout_s``): a client that trickles its body holds a
connection and a buffer, and on a predict route its model's admission, which a drain waits for;
so a read that outlasts its deadline ends in a 408 (``serving.http.replies.read_body``).

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
from typing import Any

__all__ = ["BodyDeadlines", "body_deadlines"]

# A timer may fire a little before its time (the loop's clock, its resolution): a read this
# close to its deadline is past it, rather than the timer re-armed for a moment.
_SLACK_S = 0.001


class BodyDeadlines:
    """The body reads in progress on one event loop, each with its deadline."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._reads: dict[asyncio.Task[Any], float] = {}
        self._expired: set[asyncio.Task[Any]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def start(self, task: asyncio.Task[Any], timeout_s: float) -> None:
        """``task`` reads a body from now, for at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._reads[task] = deadline
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._arm(deadline)

    def end(self, task: asyncio.Task[Any]) -> None:
        """``task``'s read is over (read whole, refused, or failed)."""
        self._reads.pop(task, None)
        self._expired.discard(task)

    def expired(self, task: asyncio.Task[Any]) -> bool:
        """Whether ``task`` was cancelled here, its deadline passed (once: it is forgotten)."""
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    @property
    def reading(self) -> int:
        return len(self._reads)

    def _arm(self, at: float) -> None:
        self._timer_at = at
        self._timer = self.loop.call_later(max(0.0, at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, math.inf
        now = time.monotonic() + _SLACK_S
        following = math.inf
        for task, deadline in list(self._reads.items()):
            if deadline <= now:
                del self._reads[task]
                self._expired.add(task)
                task.cancel()
            elif deadline < following:
                following = deadline
        if following < math.inf:
            self._arm(following)


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
