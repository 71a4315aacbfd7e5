"""Priority levels of a generating model's prompts: the waiting queue, one per level, and who
gives way to whom (issue 41).

- ``Levels``: the configured names, highest first (``high``, ``low`` by default), and the default
  level of a request that names none. A name not among them is a 400 naming the known ones.
- ``WaitingQueue``: one FIFO per level, each with its own limit (``max_waiting_prompts``): a flood
  of low prompts fills the low queue only, and a high prompt is refused (503) only when the high
  queue is full. A prompt leaves from the highest level that has one; a preempted sequence goes
  back at the head of its level (it was admitted before any prompt waiting there).
- ``pick_victim``: the running sequence a waiting prompt of a higher level preempts, where every
  slot is taken: the lowest level first, then the one admitted last (the least work redone, as
  vLLM's), never one preempted ``max_preemptions`` times already.

Policy only: the scheduler (``serving.generation.scheduler``) frees the victim's slot and
prefills it again from its prompt and what it generated (the fault path's re-prefill).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from serving.errors import InvalidInputError, QueueFullError
from serving.generation.sequence import Sequence
from serving.quoting import quote

__all__ = ["DEFAULT_LEVELS", "Levels", "WaitingQueue", "pick_victim"]

DEFAULT_LEVELS = ("high", "low")


@dataclass(frozen=True)
class Levels:
    names: tuple[str, ...] = DEFAULT_LEVELS  # highest first
    default: str = "low"

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("priority levels: give at least one")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"priority levels must differ, got {list(self.names)}")
        if self.default not in self.names:
            raise ValueError(
                f"default priority {self.default!r} is not among the levels {list(self.names)}"
            )

    def rank(self, name: str) -> int:
        """0 for the highest level."""
        return self.names.index(name)

    def resolve(self, asked: object, header: str | None = None) -> str:
        """The level of a request: its ``priority`` field, else its ``X-Priority`` header, else
        the default; a name not known is a 400 naming the known ones."""
        if asked is not None:
            return self._known(asked, "priority")
        if header is not None:
            return self._known(header.strip(), "header X-Priority")
        return self.default

    def _known(self, value: object, field: str) -> str:
        if isinstance(value, str) and value in self.names:
            return value
        raise InvalidInputError(
            f"{field} is {quote(value)}; the priority levels are {', '.join(self.names)} "
            f"(highest first; default {self.default})"
        )


class WaitingQueue:
    """The prompts waiting for a slot, by level. Iterates (and ``[0]``) in the order they would
    leave: the highest level first, first come first within a level."""

    def __init__(self, levels: Levels, max_waiting: int) -> None:
        self.levels = levels
        self.max_waiting = max_waiting
        self._queues: list[deque[Sequence]] = [deque() for _ in levels.names]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)

    def __bool__(self) -> bool:
        return any(self._queues)

    def __iter__(self) -> Iterator[Sequence]:
        for queue in self._queues:
            yield from queue

    def __getitem__(self, index: int) -> Sequence:
        for queue in self._queues:
            if index < len(queue):
                return queue[index]
            index -= len(queue)
        raise IndexError("no prompt waits there")

    def at(self, rank: int) -> int:
        """How many wait at level ``rank``."""
        return len(self._queues[rank])

    def check_room(self, rank: int | None = None) -> None:
        """``QueueFullError`` (503, Retry-After) when level ``rank``'s queue is full (``None``:
        when every level's is: nothing could be taken)."""
        ranks = range(len(self._queues)) if rank is None else (rank,)
        if all(len(self._queues[r]) >= self.max_waiting for r in ranks):
            name = "every level" if rank is None else f"priority {self.levels.names[rank]}"
            raise QueueFullError(
                f"{len(self._queues[ranks[0]])} prompts of {name} are waiting for a slot "
                f"(max_waiting_prompts={self.max_waiting} per level); retry later",
                retry_after_s=1.0,
            )

    def append(self, seq: Sequence) -> None:
        self._queues[seq.rank].append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence: back at the head of its level."""
        self._queues[seq.rank].appendleft(seq)

    def popleft(self) -> Sequence:
        for queue in self._queues:
            if queue:
                return queue.popleft()
        raise IndexError("no prompt waits")

    def remove(self, seq: Sequence) -> None:
        self._queues[seq.rank].remove(seq)

    def clear(self) -> None:
        for queue in self._queues:
            queue.clear()

    def top_rank(self) -> int | None:
        """The highest level with a live prompt waiting (one whose client still waits)."""
        for rank, queue in enumerate(self._queues):
            if any(not s.gone for s in queue):
                return rank
        return None


def pick_victim(running: Iterable[Sequence], rank: int, max_preemptions: int) -> Sequence | None:
    """The running sequence a prompt of level ``rank`` may preempt: of a lower level (a higher
    rank), preempted fewer than ``max_preemptions`` times, its client still waiting; the lowest
    level first, then the one admitted last. ``None``: none may be."""
    candidates = [
        s
        for s in running
        if s.rank > rank and s.preemptions < max_preemptions and not s.gone and not s.needs_prefill
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda s: (s.rank, s.admitted_at or 0.0))
