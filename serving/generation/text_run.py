"""One request's sequences generating text, handed out as their tokens come: what the OpenAI
routes (plain and streamed) and the V2 ``generate_stream`` read.

Each prompt is one sequence of the scheduler (``Scheduler.generate`` with an ``on_token``
callback that only queues: the scheduler's step never waits on a client). ``next()`` takes
everything queued since the last call, so a client that reads slower than the model generates
gets its tokens coalesced, and holds at most its sequences' ``max_tokens`` ids in its queue. A
``stop`` string ends its sequence: its task is cancelled, and its slot is free at the end of the
step in flight (the hang-up path). ``close()`` cancels what still runs (a client gone).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from serving.generation.detokenize import IncrementalText, StopCut
from serving.generation.scheduler import GenerationObserver, Scheduler
from serving.generation.sequence import Completion, GenerationParams
from serving.generation.tokenizer import TextTokenizer

__all__ = ["ChoiceDelta", "TextRun"]


@dataclass
class ChoiceDelta:
    """What one choice adds: its new text, the ids (and log-probabilities) that made it, and
    why it ended (``"stop"``, ``"length"``) in its last delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(eq=False)
class _Choice:
    index: int
    prompt: tuple[int, ...]
    text: IncrementalText
    stop: StopCut
    task: asyncio.Task[Completion] | None = None
    tokens: int = 0
    finished: bool = False


# An event of the queue: (choice index, token id, logprob), or (choice index, None, 0.0) when
# its sequence's task has ended.
_Event = tuple[int, int | None, float]


class TextRun:
    def __init__(
        self,
        scheduler: Scheduler,
        prompts: Sequence[tuple[int, ...]],
        params: GenerationParams,
        tokenizer: TextTokenizer,
        stops: Sequence[str] = (),
        deadline: float | None = None,
        priority: str | None = None,
    ) -> None:
        self._scheduler = scheduler
        self.priority = priority  # its level; None: the default
        self._params = params
        self.deadline = deadline  # time.monotonic(); None: none
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._choices = [
            _Choice(i, prompt, IncrementalText(tokenizer), StopCut(stops))
            for i, prompt in enumerate(prompts)
        ]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt) for c in self._choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self._choices)

    @property
    def observer(self) -> GenerationObserver | None:
        return self._scheduler.observer

    @property
    def done(self) -> bool:
        return all(c.finished for c in self._choices)

    def start(self) -> None:
        """Queue every prompt (refused at once, 503, where the scheduler's queue is full)."""
        for choice in self._choices:
            index = choice.index

            def on_token(token_id: int, logprob: float, index: int = index) -> None:
                self._queue.put_nowait((index, token_id, logprob))

            def stopped(stop: StopCut = choice.stop) -> bool:
                return stop.stopped

            task = asyncio.ensure_future(
                self._scheduler.generate(
                    choice.prompt, self._params, self.deadline, on_token, stopped, self.priority
                )
            )
            task.add_done_callback(partial(self._ended, index))
            choice.task = task

    def _ended(self, index: int, _: object) -> None:
        self._queue.put_nowait((index, None, 0.0))

    async def next(self) -> list[ChoiceDelta] | None:
        """The deltas of what came since the last call (waits for something); ``None`` once
        every choice has ended. A sequence that failed raises its error (the others are
        cancelled)."""
        if self.done:
            return None
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        deltas: dict[int, ChoiceDelta] = {}
        try:
            for index, token_id, logprob in events:
                choice = self._choices[index]
                if choice.finished:
                    continue
                delta = deltas.setdefault(index, ChoiceDelta(index))
                if token_id is None:
                    self._end(choice, delta)
                else:
                    self._token(choice, delta, token_id, logprob)
        except BaseException:
            await self.close()
            raise
        return [d for d in deltas.values() if d.text or d.finish_reason or d.token_ids]

    async def close(self) -> None:
        """Cancel the sequences still generating (their slots free within one step)."""
        tasks = [c.task for c in self._choices if c.task is not None and not c.task.done()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    def _token(self, choice: _Choice, delta: ChoiceDelta, token_id: int, logprob: float) -> None:
        choice.tokens += 1
        delta.token_ids.append(token_id)
        delta.logprobs.append(logprob)
        delta.text += choice.stop.push(choice.text.push(token_id))
        if choice.stop.stopped:
            choice.finished = True
            delta.finish_reason = "stop"
            assert choice.task is not None
            choice.task.cancel()  # its slot is free at the end of the step in flight

    def _end(self, choice: _Choice, delta: ChoiceDelta) -> None:
        task = choice.task
        assert task is not None
        done = task.result()  # its failure (504, 503, 422) raises here
        choice.finished = True
        delta.text += choice.stop.push(choice.text.flush())
        delta.text += choice.stop.flush()
        delta.finish_reason = "stop" if choice.stop.stopped else done.finish_reason
