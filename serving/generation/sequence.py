"""One generating sequence as the scheduler sees it: a plain record (vLLM's ``Request``).

Its tokens so far (the prompt and what it generated), its slot on its replica, its state, and
the future its client awaits. The scheduler (``serving.generation.scheduler``) moves it between
states; nothing here awaits.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from shards.generation.contract import RowStep, Sampling

if TYPE_CHECKING:
    from serving.telemetry.stamp import Stamp

__all__ = [
    "Completion",
    "GenerationParams",
    "SeqState",
    "Sequence",
    "TokenCallback",
    "pinned_seed",
]

# Called with each generated id (a stop id not among them) and its log-probability as the step
# that sampled it ends: a stream hands tokens out as they come. It must not block or raise.
TokenCallback = Callable[[int, float], None]


class SeqState(enum.Enum):
    WAITING = "waiting"  # queued: no slot yet
    RUNNING = "running"  # owns a slot on its replica; takes one token per step
    FINISHED = "finished"  # done, cancelled or failed: its slot is free


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks of its generation: ``max_tokens`` new tokens at most, sampled with
    ``sampling``; it stops at the first generated id in ``stop_ids``."""

    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()


def pinned_seed(params: GenerationParams, draw: Callable[[], int]) -> GenerationParams:
    """A sampled request without a seed gets a ``draw_key`` (``draw()``), so that its draws are
    keyed by (key, token index) as a seeded one's: prefilled again after a preemption or a lost
    replica, it draws the same tokens. Greedy and seeded ones are as they came."""
    sampling = params.sampling
    if sampling.temperature == 0.0 or sampling.seed is not None or sampling.draw_key is not None:
        return params
    return replace(params, sampling=replace(sampling, draw_key=draw()))


@dataclass(frozen=True)
class Completion:
    """What a finished sequence answers: the generated ids (a stop id not among them) and why it
    ended: ``"stop"`` (a stop id), ``"length"`` (``max_tokens`` or the slot's end)."""

    output_ids: tuple[int, ...]
    finish_reason: str
    prompt_tokens: int


@dataclass(eq=False)
class Sequence:
    prompt: tuple[int, ...]
    params: GenerationParams
    arrived: float  # time.monotonic() at submit
    future: asyncio.Future[Completion]
    generated: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    replica: int | None = None  # index of the replica whose stages hold its slot
    slot: int | None = None
    # Its next row is a prefill: at its start, and again after its replica was lost (from the
    # prompt and what it generated so far: the cache is rebuilt, nothing is lost).
    needs_prefill: bool = True
    first_token_at: float | None = None
    last_token_at: float | None = None
    on_token: TokenCallback | None = None
    # Its request's stamp (the access log's tokens and TTFT, the span it goes under), where it
    # came through the data plane.
    stamp: Stamp | None = None
    admitted_at: float | None = None  # when it took its slot
    decode_steps: int = 0  # steps that took one of its tokens after a prefill
    # Its priority level (``serving.generation.levels``): the name, and its rank (0 = highest).
    priority: str = "low"
    rank: int = 0
    preemptions: int = 0  # times a higher level's prompt took its slot

    @property
    def gone(self) -> bool:
        """Its client no longer waits (it hung up, or its deadline passed)."""
        return self.future.done()

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)

    def next_row(self) -> RowStep:
        """Its row of the next step: the whole sequence at a prefill, else its last token."""
        assert self.slot is not None
        index = len(self.generated)
        if self.needs_prefill:
            return RowStep(
                self.slot, (*self.prompt, *self.generated), 0, self.params.sampling, index
            )
        return RowStep(
            self.slot, (self.generated[-1],), self.length - 1, self.params.sampling, index
        )

    def add_token(self, token_id: int, max_length: int) -> str | None:
        """Record a sampled token; why the sequence ends with it (``"stop"``, ``"length"``),
        else ``None``. A stop id ends it and is not part of the answer."""
        self.needs_prefill = False
        if token_id in self.params.stop_ids:
            return "stop"
        self.generated.append(token_id)
        if len(self.generated) >= self.params.max_tokens or self.length >= max_length:
            return "length"
        return None

    def preempt(self) -> None:
        """Its slot was taken: it waits again, to be prefilled from its prompt and what it
        generated so far (its next draws keyed as before: the same tokens)."""
        self.state = SeqState.WAITING
        self.replica = self.slot = None
        self.needs_prefill = True
        self.preemptions += 1

    def completion(self, reason: str) -> Completion:
        return Completion(tuple(self.generated), reason, len(self.prompt))
