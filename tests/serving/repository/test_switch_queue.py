"""The deeper queue of a switch (``serving.repository.switch_queue``): widened by a factor
unless the operator sized it, and narrowed only once the backlog is within the version's own
rows (or the wait gave up), so that narrowing never refuses what a backlog still holds."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from serving.batching.settings import BatchSettings
from serving.metrics.series import Metrics
from serving.repository.switch_queue import (
    SWITCH_QUEUE_FACTOR,
    backlog_within_own,
    narrow_queues,
    widen_queue,
)
from serving.settings.config import Settings
from serving.version.served import ServedModel


@dataclass
class FakeBatcher:
    max_queue_rows: int
    queued_rows: int = 0
    settings: Any = field(init=False)

    def __post_init__(self) -> None:
        self.settings = SimpleNamespace(max_queue_rows=self.max_queue_rows)

    def reconfigure(self, max_queue_rows: int) -> Any:
        self.settings.max_queue_rows = max_queue_rows
        return self.settings


def version(rows: int = 64, operator_rows: int | None = None) -> Any:
    settings = Settings(model="fake", max_queue_rows=operator_rows)
    model = ServedModel("m", settings, Metrics())
    model.batcher = FakeBatcher(rows)  # type: ignore[assignment]
    model.limits.start = BatchSettings(max_batch_size=min(rows, 32), max_queue_rows=rows)
    return model


def test_a_queue_widens_once_and_narrows_back_to_its_own_rows() -> None:
    model = version(64)
    widen_queue(model)
    widen_queue(model)  # once only
    assert model.batcher.settings.max_queue_rows == 64 * SWITCH_QUEUE_FACTOR
    assert model.queue_widened == (64, 64 * SWITCH_QUEUE_FACTOR)
    narrow_queues([model])
    assert (model.batcher.settings.max_queue_rows, model.queue_widened) == (64, None)


def test_a_queue_the_operator_sized_or_a_version_without_a_batcher_is_left_alone() -> None:
    sized = version(64, operator_rows=64)
    unloaded = version()
    unloaded.batcher = None
    widen_queue(sized)
    widen_queue(unloaded)
    assert (sized.batcher.settings.max_queue_rows, sized.queue_widened) == (64, None)
    assert unloaded.queue_widened is None


async def test_narrowing_waits_until_the_backlog_is_within_the_own_rows() -> None:
    model, other = version(64), version(8)
    widen_queue(model)
    model.batcher.queued_rows = 150  # what the old version's drain left it
    other.batcher.queued_rows = 500  # not widened: not waited for
    waiting = asyncio.create_task(backlog_within_own([model, other], timeout_s=30.0))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    model.batcher.queued_rows = 64
    await asyncio.wait_for(waiting, 5.0)


async def test_the_wait_for_the_backlog_gives_up_after_its_timeout() -> None:
    model = version(64)
    widen_queue(model)
    model.batcher.queued_rows = 150  # a load above capacity: it never drains
    await asyncio.wait_for(backlog_within_own([model], timeout_s=0.2), 5.0)
