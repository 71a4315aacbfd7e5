"""What the offered load of a version needs, in replicas: the estimate behind a scale-up that asks
for several at once (``serving.elastic.policy``'s ``demand``).

A version whose queue is full answers 503 to what it cannot hold, so its queue's wait alone says
"more", not "how many more". The requests offered over those answered without a 503, times the
healthy replicas that answered them, says how many: at 2.5x what one replica delivers, 3.
"""

from __future__ import annotations

from collections import deque

__all__ = ["DEMAND_MIN_ANSWERS", "DEMAND_WINDOW_S", "Offered"]

# The shortest window the offered load is measured over (the upscale delay when longer).
DEMAND_WINDOW_S = 5.0
# Fewer answers than this in the window tell nothing about what the load needs.
DEMAND_MIN_ANSWERS = 20


class Offered:
    """What the offered load needs, from the version's answers (every protocol's, through its
    metrics' listener): the healthy replicas times the requests answered over those answered
    without a 503 (a full queue, no healthy replica), over the last ``window_s``."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._answers = self._refused = 0
        # (when, answers, refused so far); the first mark stands for the first sample.
        self._marks: deque[tuple[float, int, int]] = deque([(float("-inf"), 0, 0)])

    def answered(self, status: int, seconds: float) -> None:
        self._answers += 1
        self._refused += status == 503

    def demand(self, now: float, healthy: int) -> float | None:
        self._marks.append((now, self._answers, self._refused))
        while len(self._marks) > 1 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()
        _, answers, refused = self._marks[0]
        answers, refused = self._answers - answers, self._refused - refused
        served = answers - refused
        if answers < DEMAND_MIN_ANSWERS or served <= 0 or healthy < 1:
            return None
        return healthy * answers / served
