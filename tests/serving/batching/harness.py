"""What the batching tests share: a harness that starts batchers and keeps what they report, a
clock the test moves, a batch held running at the fake runner's gate, the run-time model seeded
as if batches had run, and a wait policy with a bug in it (for the loop's crash handling)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import serving.batching.batcher
from serving.batching.batcher import Batcher, BatchSettings
from serving.batching.lengths import LengthPadding
from serving.batching.wait import WaitPolicy
from serving.telemetry.batch_record import BatchRecord
from tests.fakes import FakeRunner, expected_outputs, make_rows, spawn

LONG_MS = 60_000.0  # a timeout no test waits for: batches then close on size or flush only


class FakeClock:
    """``time.monotonic`` moved forward at will. The event loop reads it too, so its timers
    (the batcher's timeouts, a request's deadline) fall due when the test moves the clock past
    them: deadlines far longer than any stall of a loaded machine, reached at once."""

    def __init__(self) -> None:
        self._real = time.monotonic
        self._offset = 0.0

    def __call__(self) -> float:
        return self._real() + self._offset

    def advance(self, seconds: float) -> None:
        self._offset += seconds


class Harness:
    def __init__(self) -> None:
        self.records: list[BatchRecord] = []
        self.rejects: list[str] = []
        self.batchers: list[Batcher] = []

    async def __call__(
        self,
        runner: FakeRunner | Callable[..., Any],
        lengths: LengthPadding | None = None,
        **policy: Any,
    ) -> Batcher:
        run = runner.run_batch if isinstance(runner, FakeRunner) else runner
        batcher = Batcher(
            run,
            BatchSettings(**policy),
            lengths=lengths,
            on_batch=self.records.append,
            on_reject=self.rejects.append,
        )
        await batcher.start()
        self.batchers.append(batcher)
        return batcher


def assert_rows(result: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> None:
    want = expected_outputs(inputs)
    assert result.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(result[name], want[name])


async def occupy(batcher: Batcher, runner: FakeRunner) -> asyncio.Task[dict[str, np.ndarray]]:
    """The first request, one row (id 0), whose batch is running and held at the runner's
    closed gate until ``open_gate``."""
    task = await spawn(batcher.submit(make_rows(1)))
    await runner.wait_started(1)
    return task


def open_gate(runner: FakeRunner) -> None:
    """Let every held and later batch of a gated runner finish."""
    assert runner.gate is not None
    runner.gate.set()


def seed(
    batcher: Batcher,
    walls: dict[int, float] | None = None,
    *,
    recent_s: float | None = None,
    now: float | None = None,
) -> None:
    """Seed the batcher's run-time model as if batches had run: first the average batch time
    (``recent_s``, which caps the auto policy's wait), then the driver's wall time of a batch of
    each padded size in ``walls`` (seconds; ``now`` is when it ran)."""
    if recent_s is not None:
        batcher._runtime.recent_s = recent_s
    for size, seconds in (walls or {}).items():
        batcher._runtime.observe(size, seconds, now=now)


class BuggyWait:
    """The real wait policy, but ``close_reason`` raises while ``crashes`` is above 0 (each
    raise counts one down; None: it always raises)."""

    def __init__(self, real: WaitPolicy, crashes: int | None) -> None:
        self.real = real
        self.crashes = crashes

    def close_reason(self, policy: BatchSettings, **kwargs: Any) -> str | None:
        if self.crashes is None or self.crashes > 0:
            self.crashes = None if self.crashes is None else self.crashes - 1
            raise RuntimeError("bug in the wait policy")
        return self.real.close_reason(policy, **kwargs)

    def wait_s(
        self, policy: BatchSettings, rows: int, inflight_batches: int, length: int = 0
    ) -> float:
        return self.real.wait_s(policy, rows, inflight_batches, length)

    def batch_limit(
        self, policy: BatchSettings, waited_s: float, now: float, queued: int, length: int = 0
    ) -> int:
        return self.real.batch_limit(policy, waited_s, now, queued, length)


def buggy_wait(monkeypatch: pytest.MonkeyPatch, crashes: int | None) -> None:
    """Batchers made from now on get a ``BuggyWait`` around their real wait policy."""
    real = serving.batching.batcher.wait_policy
    monkeypatch.setattr(
        serving.batching.batcher,
        "wait_policy",
        lambda policy, rt: BuggyWait(real(policy, rt), crashes),
    )
