"""The requests a version admitted and has not answered yet: what its drain waits for.

The data plane holds one (``Admitted.hold``) from admission to the answer; the version's drain
(``serving.version.served``) waits for none to be held before it stops the batcher.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["Admitted"]


class Admitted:
    """The requests a model admitted and has not answered yet.

    A request passes admission, then awaits its body, then queues its rows: a drain that began
    in between (a version switch, a stop) would stop the batcher under it and refuse a request
    it had admitted. The model's drain waits for these first (within its budget), so that
    every admitted request is answered by the model that admitted it."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until none is held (True), or ``timeout_s`` passed (False)."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True
