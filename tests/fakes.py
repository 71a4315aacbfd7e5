"""A fake model runner for tests that need a model but neither Ray nor TensorFlow.

``FakeRunner`` has the shape of ``serving.version.runner.ModelRunner``. Every output row is a
deterministic function of its own input row, so a test can tell rows apart and check their order:
for each output, the row is filled with ``[s, m, s, m, ...]`` where ``s`` is the sum and ``m`` the
maximum of all elements of that row over every input (dimensions of size ``None`` count as 1).
With the default signature (input ``x`` of shape (4,), output ``y`` of shape (2,)) that is
``y = [sum(x), max(x)]``.

Tests wait on events, never on sleeps: ``gate`` holds every call until it is set, and
``wait_started(n)`` returns once the n-th call has begun.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

import numpy as np

from shards.errors import ModelError
from shards.pipeline.health import Health
from shards.signature import ModelSignature, TensorSpec

T = TypeVar("T")
# The longest a test waits for an event the code under test should set: a bug fails the test
# in seconds instead of holding it to pytest-timeout's limit.
WAIT_S = 10.0

DEFAULT_SIGNATURE = ModelSignature(
    name="fake",
    inputs=(TensorSpec("x", (4,), "float32"),),
    outputs=(TensorSpec("y", (2,), "float32"),),
)


def expected_outputs(
    inputs: dict[str, np.ndarray], signature: ModelSignature = DEFAULT_SIGNATURE
) -> dict[str, np.ndarray]:
    """What ``FakeRunner.run_batch`` returns for ``inputs`` (the reference for assertions)."""
    rows = len(next(iter(inputs.values())))
    flat = np.concatenate(
        [np.asarray(inputs[k], dtype=np.float64).reshape(rows, -1) for k in sorted(inputs)], axis=1
    )
    pair = np.stack([flat.sum(axis=1), flat.max(axis=1)], axis=1)
    out: dict[str, np.ndarray] = {}
    for spec in signature.outputs:
        row_shape = tuple(1 if d is None else d for d in spec.shape)
        size = int(np.prod(row_shape, dtype=np.int64))
        filled = np.tile(pair, (1, (size + 1) // 2))[:, :size]
        out[spec.name] = filled.reshape((rows, *row_shape)).astype(spec.np_dtype)
    return out


def make_rows(n: int, *, start: int = 0, width: int = 4, name: str = "x") -> dict[str, np.ndarray]:
    """``n`` distinct float32 rows: row i is ``[start+i, start+i, ...] + [0, 0.1, 0.2, ...]``."""
    ids = np.arange(start, start + n, dtype=np.float32)[:, None]
    return {name: ids + np.arange(width, dtype=np.float32)[None, :] / 10}


def row_ids(batch: dict[str, np.ndarray], name: str = "x") -> list[int]:
    """The ``start+i`` ids of the rows ``make_rows`` built, as a batch received them."""
    return [int(v) for v in np.floor(batch[name][:, 0])]


class FakeRunner:
    """Records every batch; optionally waits on ``gate`` and raises ``fail_with`` per call.

    ``poison``: a batch holding a row whose first value is negative raises the ``ModelError``
    a real model's bad-index error becomes (input blamed), like an embedding lookup would.
    """

    num_stages = 1
    replicas = 1
    on_gpu = False

    def __init__(
        self,
        signature: ModelSignature = DEFAULT_SIGNATURE,
        *,
        gate: asyncio.Event | None = None,
        fail_with: BaseException | None = None,
        poison: bool = False,
    ) -> None:
        self.signature = signature
        self.poison = poison
        self.healthy = 1
        # None healthy but one being brought back, expected in ``back_in_s`` (``Health``).
        self.recovering = False
        self.back_in_s = 0.0
        self.gate = gate
        self.fail_with = fail_with
        self.batches: list[dict[str, np.ndarray]] = []
        self.calls_started = 0
        self.calls_finished = 0
        self.running = 0
        self.max_running = 0
        self.warmed: list[int] = []
        self.closed = False
        self._started_events: dict[int, asyncio.Event] = {}

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append({k: np.array(v, copy=True) for k, v in inputs.items()})
        self.calls_started += 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        self._event(self.calls_started).set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail_with is not None:
                raise self.fail_with
            if self.poison:
                first = next(iter(inputs.values())).reshape(len(next(iter(inputs.values()))), -1)
                bad = np.flatnonzero(first[:, 0] < 0)
                if bad.size:
                    raise ModelError(
                        f"InvalidArgumentError: indices[{bad[0]},0] = {first[bad[0], 0]:g} "
                        "is not in [0, 10)",
                        input_blamed=True,
                    )
            return expected_outputs(inputs, self.signature)
        finally:
            self.running -= 1
            self.calls_finished += 1

    async def wait_started(self, n: int) -> None:
        """Return once call number ``n`` (1-based) has started; fail after ``WAIT_S``."""
        await asyncio.wait_for(self._event(n).wait(), WAIT_S)

    async def warmup(self, batch_sizes: tuple[int, ...] | list[int]) -> None:
        self.warmed.extend(batch_sizes)

    def health(self) -> Health:
        states = ("healthy",) * self.healthy + ("dead",) * (self.replicas - self.healthy)
        return Health(
            self.replicas,
            self.healthy,
            states,
            reason="stage 0 died",
            recovering=self.recovering,
            back_in_s=self.back_in_s,
        )

    async def stats(self) -> list[dict[str, Any]]:
        return [{"replica": 0, "stage_index": 0, "calls": self.calls_finished}]

    async def close(self) -> None:
        self.closed = True

    def batch_sizes(self) -> list[int]:
        """Rows of every batch received so far (after padding)."""
        return [len(next(iter(b.values()))) for b in self.batches]

    def _event(self, n: int) -> asyncio.Event:
        return self._started_events.setdefault(n, asyncio.Event())


async def spawn(coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """Start ``coro`` as a task and let it run up to its first real wait.

    ``Batcher.submit`` queues its rows before it first awaits, so after ``spawn`` the rows are
    queued (or rejected) and the test can look at the batcher's state.
    """
    task = asyncio.create_task(coro)
    await asyncio.sleep(0)
    return task


async def settle(aw: Awaitable[T]) -> T | BaseException:
    """Await ``aw`` and return its result or the exception it raised."""
    try:
        return await aw
    except BaseException as exc:  # tests inspect whatever came out, cancellation included
        return exc


def put_in_state(model: Any, *path: str, reason: str | None = None) -> None:
    """Walk a served version (``serving.version.served.ServedModel``) along ``path`` of its
    state machine's transitions (e.g. ``"WARMING", "READY"``) without a load: for a unit test
    that needs a version in a state. Each step is checked as in the server (an illegal one
    raises); ``reason`` goes with the last step (FAILED, DRAINING)."""
    from serving.version.life import VersionState

    life = model._life
    for i, name in enumerate(path):
        life.move(VersionState(name), reason if i == len(path) - 1 else None)
