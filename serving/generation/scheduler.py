"""The iteration-level scheduler: the model runs one step at a time over the running sequences,
each at its own position (Orca, OSDI'22; vLLM's v1 scheduler).

Mechanism only; who joins a step is ``serving.generation.policy``'s. Pure asyncio: the replicas
are ``shards.generation.contract.GenerationReplica`` objects (a fake in the tests).

- New prompts wait in one queue per priority level (``serving.generation.levels``:
  ``max_waiting`` of each, then 503 with Retry-After); the highest level's leave first. Where
  every slot is taken, a waiting prompt preempts a running sequence of a lower level at its
  group's step boundary: that one waits again at the head of its level and is prefilled again
  as after ``ReplicaLost`` (its client sees a delay only).
- Each replica runs ``groups`` groups of sequences (K stages: K + 1 by default), each its own
  loop of one ``step()`` in flight: while stage 2 computes group n's step, stage 1 computes
  group n+1's (vLLM's pipeline-parallel "virtual engines"). A group takes waiting prompts at its
  step boundary when the policy says so; their prefill rows share the step with its decode rows.
  A prompt goes to a replica with a free slot: whichever group has room takes it.
- A sequence owns one slot of its replica from its prefill to its end; it leaves between steps
  (a stop id among its generated ids, ``max_tokens``, the slot's end) and its slot is free at
  once. A client that hangs up (its awaiting task cancelled) or whose deadline passes leaves
  at the end of the step in flight; a queued prompt whose client left never starts.
- ``ReplicaLost``: after ``wait_ready()`` every sequence of that replica is prefilled again from
  its prompt and what it generated so far (the draw of token t is keyed by (seed, t): the
  client gets the same tokens). ``StepFailed``: those rows fail alone (422); the others run
  their step again.

It stays one idea past 500 lines: the queue, the groups' loops and the fault paths all move the same
sequence records between the same states and own the same slots; apart, each would reach into
the others' records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from serving.errors import (
    BatchFailedError,
    DeadlineExceededError,
    ModelInputError,
    NotReadyError,
    QueueFullError,
    ShardServeError,
)
from serving.generation.knobs import GenerationKnobs, within_budget
from serving.generation.levels import Levels, WaitingQueue, pick_victim
from serving.generation.policy import admit_count
from serving.generation.sequence import (
    Completion,
    GenerationParams,
    SeqState,
    Sequence,
    TokenCallback,
    pinned_seed,
)
from serving.telemetry import active
from serving.telemetry.stamp import CURRENT
from shards.errors import one_line
from shards.generation.contract import (
    GenerationInfo,
    GenerationReplica,
    ReplicaLost,
    RowResult,
    StepFailed,
)

if TYPE_CHECKING:
    from serving.telemetry.active import Tracer

__all__ = ["GenerationObserver", "Scheduler", "SchedulerSettings"]

log = logging.getLogger("shardserve")


class GenerationObserver(Protocol):
    """What the scheduler tells the metrics (``serving.metrics``)."""

    def observe_step(self, kind: str, rows: int) -> None:
        """A step of ``rows`` rows ran; ``kind``: ``"prefill"`` (it held a prefill row) or
        ``"decode"``."""

    def observe_first_token(self, seconds: float, priority: str) -> None:
        """A sequence of level ``priority`` had its first token ``seconds`` after its prompt
        arrived."""

    def observe_queue_wait(self, seconds: float, priority: str) -> None:
        """A prompt of level ``priority`` took its slot ``seconds`` after it arrived."""

    def observe_preemption(self, priority: str) -> None:
        """A running sequence of level ``priority`` gave its slot to a higher level's prompt."""

    def observe_refusal(self, priority: str) -> None:
        """A prompt of level ``priority`` was refused: its level's queue was full."""

    def observe_token_gap(self, seconds: float) -> None:
        """A sequence's later token came ``seconds`` after its previous one."""

    def observe_tokens(self, count: int) -> None:
        """``count`` tokens were generated (answered or not)."""

    def observe_stream(self, outcome: str) -> None:
        """A stream ended: ``done``, ``length``, ``stop``, ``cancelled``, ``deadline`` or
        ``error`` (``serving.protocols.streaming``)."""


@dataclass(frozen=True)
class SchedulerSettings:
    """``max_running_sequences``: the most sequences one replica generates at once (at most its
    ``kv_slots``; ``None``: all of them). ``prefill_timeout_ms``: how long the oldest prompt may
    wait for others to join its prefill (``None``: auto, ``serving.generation.policy``).
    ``prefill_budget_tokens``: the most prompt tokens joining one step (``None``: no cap).
    ``max_waiting``: the most prompts queued per priority level. ``groups``: the groups in
    flight per replica (``None``: its stages + 1). The first three are the start of
    ``GenerationKnobs``, which owns them from then on (the admin route changes them there).
    ``levels``: the priority levels; ``max_preemptions``: the most times one sequence gives its
    slot to a higher level (0: never preempt)."""

    max_running_sequences: int | None = None
    prefill_timeout_ms: float | None = None
    prefill_budget_tokens: int | None = None
    max_waiting: int = 128
    groups: int | None = None
    levels: Levels = field(default_factory=Levels)
    max_preemptions: int = 2


@dataclass(eq=False)
class _Group:
    seqs: list[Sequence] = field(default_factory=list)


@dataclass(eq=False)
class _Replica:
    index: int
    replica: GenerationReplica
    free_slots: list[int]
    groups: list[_Group]
    running: int = 0
    recovery: asyncio.Future[None] | None = None


class Scheduler:
    def __init__(
        self,
        replicas: Seq[GenerationReplica],
        settings: SchedulerSettings = SchedulerSettings(),
        observer: GenerationObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("a scheduler needs at least one replica")
        self.info: GenerationInfo = replicas[0].info
        self._clock = clock
        self.observer = observer
        self._max_waiting = settings.max_waiting
        groups = settings.groups or self.info.stages + 1
        self._replicas = [
            _Replica(
                i,
                r,
                list(reversed(range(r.info.kv_slots))),  # pop() hands out slot 0 first
                [_Group() for _ in range(groups)],
            )
            for i, r in enumerate(replicas)
        ]
        self.levels = settings.levels
        self._max_preemptions = settings.max_preemptions
        self._waiting = WaitingQueue(settings.levels, settings.max_waiting)
        self._wake = asyncio.Event()
        self.knobs = GenerationKnobs(
            self.info.kv_slots,
            max_running_sequences=settings.max_running_sequences,
            prefill_timeout_ms=settings.prefill_timeout_ms,
            prefill_budget_tokens=settings.prefill_budget_tokens,
        )
        self.knobs.on_change(self._notify)  # a prompt may join now
        self._tasks: list[asyncio.Task[None]] = []
        self._closing: str | None = None

    # ---- what the metrics read (the knobs are ``self.knobs``'s, read at every step)

    @property
    def max_running_sequences(self) -> int:
        return self.knobs.max_running_sequences

    @property
    def running(self) -> int:
        return sum(r.running for r in self._replicas)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def waiting_at(self, priority: str) -> int:
        """Prompts of level ``priority`` waiting (preempted sequences among them)."""
        return self._waiting.at(self.levels.rank(priority))

    @property
    def free_slots(self) -> int:
        return sum(len(r.free_slots) for r in self._replicas)

    # ---- life

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run_group(rep, group), name=f"generation group {rep.index}.{i}")
            for rep in self._replicas
            for i, group in enumerate(rep.groups)
        ]

    async def close(self, reason: str = "the model is stopping") -> None:
        """Refuse new prompts, fail those not answered yet (503 with ``reason``), stop the
        groups and close the replicas. Whoever drains waits for what it admitted first."""
        self._closing = reason
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        error = NotReadyError(reason)
        for seq in self._waiting:
            _fail(seq, error)
        self._waiting.clear()
        for rep in self._replicas:
            for group in rep.groups:
                for seq in list(group.seqs):
                    self._release(rep, group, seq)
                    _fail(seq, error)
        for rep in self._replicas:
            try:
                await rep.replica.close()
            except Exception:
                log.warning("closing generation replica %d failed", rep.index, exc_info=True)

    # ---- a request

    def check_headroom(self, priority: str | None = None) -> None:
        """``QueueFullError`` (503, Retry-After) when ``max_waiting`` prompts of level
        ``priority`` wait already (``None``: of every level)."""
        rank = None if priority is None else self.levels.rank(priority)
        try:
            self._waiting.check_room(rank)
        except QueueFullError:
            if priority is not None and self.observer is not None:
                self.observer.observe_refusal(priority)
            raise

    async def generate(
        self,
        prompt: Seq[int],
        params: GenerationParams,
        deadline: float | None = None,
        on_token: TokenCallback | None = None,
        stopped: Callable[[], bool] | None = None,
        priority: str | None = None,
    ) -> Completion:
        """Generate for ``prompt`` (checked by the caller: ids in the vocabulary, room in a
        slot) until it stops; ``deadline`` (``time.monotonic()``): past it, 504. Cancelling the
        caller (a hang-up) drops the sequence: queued, it never starts; running, its slot is
        free at the end of the step in flight. ``on_token``: told each generated id as its step
        ends (a stream's; the policy is untouched: it only hears). ``stopped``: whether a
        cancel is its caller's stop (a stop string met), not a hang-up (its span's reason).
        ``priority``: its level (checked by the caller, ``Levels.resolve``; ``None``: the
        default)."""
        if self._closing is not None:
            raise NotReadyError(self._closing)
        level = self.levels.default if priority is None else priority
        self.check_headroom(level)
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        params = pinned_seed(params, _draw_seed)
        seq = Sequence(tuple(prompt), params, self._clock(), future, on_token=on_token)
        seq.priority, seq.rank = level, self.levels.rank(level)
        seq.stamp = CURRENT.get()
        self._waiting.append(seq)
        future.add_done_callback(lambda _: self._left(seq))
        self._notify()
        reason = "error"
        try:
            if deadline is None:
                done = await future
            else:
                done = await asyncio.wait_for(future, max(0.0, deadline - self._clock()))
            reason = done.finish_reason
            return done
        except TimeoutError:
            reason = "deadline"
            preempted = (
                f"; it was preempted {seq.preemptions} time(s) by higher-priority prompts"
                if seq.preemptions
                else ""
            )
            raise DeadlineExceededError(
                f"the generation did not end within its deadline ({len(seq.generated)} "
                f"tokens generated{preempted}); ask for fewer max_tokens or raise "
                "generation_timeout_ms"
            ) from None
        except asyncio.CancelledError:
            # A stop string's cut (``TextRun``) cancels it too; else its client left.
            reason = "stop" if stopped is not None and stopped() else "cancelled"
            raise
        finally:
            stamp = seq.stamp
            if stamp is not None:
                stamp.finish = _merged(stamp.finish, reason)
                tracer = active.tracer
                if tracer is not None and stamp.span is not None:
                    self._trace(tracer, seq, reason)

    def _trace(self, tracer: Tracer, seq: Sequence, reason: str) -> None:
        """The sequence's span, under its request's: its time queued, its prefill, its decode
        steps, and why it ended."""
        assert seq.stamp is not None
        tracer.sequence(
            seq.stamp,
            arrived=seq.arrived,
            admitted=seq.admitted_at,
            first_token=seq.first_token_at,
            ended=self._clock(),
            attributes={
                "shardserve.prompt_tokens": len(seq.prompt),
                "shardserve.generated_tokens": len(seq.generated),
                "shardserve.decode_steps": seq.decode_steps,
                "shardserve.finish_reason": reason,
                "shardserve.replica": -1 if seq.replica is None else seq.replica,
                "shardserve.slot": -1 if seq.slot is None else seq.slot,
            },
            failed=reason in ("error", "deadline"),
        )

    def _left(self, seq: Sequence) -> None:
        """Its future is done (answered, failed, or its client gone): a queued one leaves the
        queue now; a running one leaves its group at the end of its step."""
        if seq.state is SeqState.WAITING:
            seq.state = SeqState.FINISHED
            with contextlib.suppress(ValueError):
                self._waiting.remove(seq)

    # ---- the groups

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def _sleep(self, seconds: float | None) -> None:
        """Until something changes (a prompt arrives, a slot frees) or ``seconds`` pass."""
        wake = self._wake
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), seconds)

    async def _run_group(self, rep: _Replica, group: _Group) -> None:
        while True:
            try:
                await self._fill(rep, group)
                await self._step(rep, group)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no sequence may hang on a loop that went wrong
                log.exception("generation group of replica %d failed a step", rep.index)
                error = BatchFailedError(f"the generation step failed: {one_line(exc)}")
                for seq in list(group.seqs):
                    self._release(rep, group, seq)
                    _fail(seq, error)

    async def _fill(self, rep: _Replica, group: _Group) -> None:
        """Drop the group's sequences whose clients left, take the prompts the policy lets in;
        return once the group has rows to step (waits while it has none)."""
        while True:
            for seq in [s for s in group.seqs if s.gone]:
                self._release(rep, group, seq)
            if rep.recovery is not None:  # its caches are lost, this group's too
                await _settled(rep.recovery)
                for seq in group.seqs:
                    seq.needs_prefill = True
                continue
            if self._waiting and self._preempt(rep, group):
                continue  # a slot of this group is free for the higher level's prompt
            knobs = self.knobs
            room = admit_count(
                limit=knobs.max_running_sequences,
                groups=len(rep.groups),
                in_group=len(group.seqs),
                on_replica=rep.running,
                slots_free=len(rep.free_slots),
            )
            if room and self._waiting:
                lengths = (s.length for s in self._waiting)
                room = within_budget(lengths, knobs.prefill_budget_tokens, room)
                waited = self._clock() - self._waiting[0].arrived
                wait_s = knobs.prefill_wait.wait_s(
                    waited_s=waited, waiting=len(self._waiting), room=room, busy=bool(group.seqs)
                )
                if wait_s <= 0:
                    self._admit(rep, group, room)
                    if group.seqs:  # else every prompt it took had left: look again
                        return
                    continue
                if group.seqs:
                    return
                await self._sleep(wait_s)
                continue
            if group.seqs:
                return
            await self._sleep(None)

    def _admit(self, rep: _Replica, group: _Group, count: int) -> None:
        while count and self._waiting:
            seq = self._waiting.popleft()
            if seq.gone:
                continue
            seq.state = SeqState.RUNNING
            seq.replica, seq.slot = rep.index, rep.free_slots.pop()
            if seq.admitted_at is None and self.observer is not None:
                self.observer.observe_queue_wait(self._clock() - seq.arrived, seq.priority)
            seq.admitted_at = self._clock()
            rep.running += 1
            group.seqs.append(seq)
            count -= 1

    def _preempt(self, rep: _Replica, group: _Group) -> bool:
        """Where every slot is taken and a prompt waits at a higher level than one of this
        group's sequences: that sequence gives up its slot and waits again (``pick_victim``).
        Whether one did."""
        rank = self._waiting.top_rank()
        if rank is None or any(
            r.recovery is None and r.free_slots and r.running < self.max_running_sequences
            for r in self._replicas
        ):
            return False
        victim = pick_victim(group.seqs, rank, self._max_preemptions)
        if victim is None:
            return False
        assert victim.slot is not None
        rep.free_slots.append(victim.slot)
        rep.running -= 1
        group.seqs.remove(victim)
        victim.preempt()
        self._waiting.requeue(victim)
        if self.observer is not None:
            self.observer.observe_preemption(victim.priority)
        return True

    def _release(self, rep: _Replica, group: _Group, seq: Sequence) -> None:
        if seq.state is SeqState.RUNNING:
            seq.state = SeqState.FINISHED
            assert seq.slot is not None
            rep.free_slots.append(seq.slot)
            rep.running -= 1
            group.seqs.remove(seq)
            self._notify()

    async def _step(self, rep: _Replica, group: _Group) -> None:
        seqs = list(group.seqs)
        assert seqs, "a step needs rows"
        rows = [seq.next_row() for seq in seqs]
        prefill = any(seq.needs_prefill for seq in seqs)
        try:
            results = await rep.replica.step(rows)
        except StepFailed as exc:
            self._step_failed(rep, group, seqs, exc)
            return
        except ReplicaLost:
            log.warning(
                "generation replica %d was lost; its %d sequence(s) of this group are "
                "prefilled again once it is back",
                rep.index, len(seqs),
            )  # fmt: skip
            await self._recover(rep, group)
            return
        if len(results) != len(rows):
            raise RuntimeError(f"a step of {len(rows)} rows answered {len(results)}")
        if self.observer is not None:
            self.observer.observe_step("prefill" if prefill else "decode", len(rows))
        self._record(rep, group, seqs, results)

    def _record(
        self, rep: _Replica, group: _Group, seqs: list[Sequence], results: list[RowResult]
    ) -> None:
        now = self._clock()
        observer = self.observer
        for seq, result in zip(seqs, results, strict=True):
            if seq.state is not SeqState.RUNNING:
                continue
            if seq.gone:
                self._release(rep, group, seq)
                continue
            if not seq.needs_prefill:
                seq.decode_steps += 1
            reason = seq.add_token(result.token_id, self.info.max_length)
            if observer is not None:
                if seq.first_token_at is None:
                    observer.observe_first_token(now - seq.arrived, seq.priority)
                else:
                    assert seq.last_token_at is not None
                    observer.observe_token_gap(now - seq.last_token_at)
                observer.observe_tokens(1)
            if seq.first_token_at is None:
                seq.first_token_at = now
            seq.last_token_at = now
            if reason != "stop":  # a stop id is not handed out
                stamp = seq.stamp
                if stamp is not None:
                    if not stamp.tokens:
                        stamp.first_token_ms = (time.perf_counter() - stamp.started) * 1000.0
                    stamp.tokens += 1
                if seq.on_token is not None:
                    seq.on_token(result.token_id, result.logprob)
            if reason is not None:
                self._release(rep, group, seq)
                seq.future.set_result(seq.completion(reason))

    def _step_failed(
        self, rep: _Replica, group: _Group, seqs: list[Sequence], exc: StepFailed
    ) -> None:
        slots: set[int | None] = {seq.slot for seq in seqs}
        blamed = slots & set(exc.slots)
        if not blamed:  # the rows it names are not this step's: none can be trusted
            blamed = slots
        error = ModelInputError(f"the model failed on this prompt: {exc.message}")
        for seq in seqs:
            if seq.slot in blamed and seq.state is SeqState.RUNNING:
                self._release(rep, group, seq)
                _fail(seq, error)
        # The others run their step again: the same rows, their caches written at the same
        # positions once more.

    async def _recover(self, rep: _Replica, group: _Group) -> None:
        """Wait for the replica to be back (one ``wait_ready()`` for all its groups), then
        prefill this group's sequences again; if it cannot come back, they fail (503)."""
        recovery = rep.recovery
        if recovery is None:
            recovery = asyncio.ensure_future(rep.replica.wait_ready())

            def back(done: asyncio.Future[None]) -> None:
                # Registered first: runs before any waiter wakes, so none sees it still set.
                if rep.recovery is done:
                    rep.recovery = None
                self._notify()

            recovery.add_done_callback(back)
            rep.recovery = recovery
        try:
            await asyncio.shield(recovery)
        except Exception as exc:
            error = NotReadyError(f"the model's replica could not be brought back: {one_line(exc)}")
            for seq in list(group.seqs):
                self._release(rep, group, seq)
                _fail(seq, error)
        for seq in group.seqs:
            seq.needs_prefill = True


# How a request's sequences ended, one word for all (the access log's ``finish``): a failure
# wins over a clean end (the others of a failed request are cancelled: the failure says why).
_RANK = {"length": 0, "stop": 0, "done": 0, "cancelled": 1, "error": 2, "deadline": 3}


def _merged(was: str, reason: str) -> str:
    if not was or was == reason:
        return reason
    if _RANK[was] == _RANK[reason] == 0:
        return "done"
    return reason if _RANK[reason] > _RANK[was] else was


def _draw_seed() -> int:
    return random.getrandbits(63)


async def _settled(future: asyncio.Future[None]) -> None:
    with contextlib.suppress(Exception):  # its waiter that started it reports a failure
        await asyncio.shield(future)


def _fail(seq: Sequence, error: ShardServeError) -> None:
    seq.state = SeqState.FINISHED
    if not seq.future.done():
        seq.future.set_exception(error)
