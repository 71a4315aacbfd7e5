"""The fixtures of the batching tests (their helpers are in ``harness.py``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from tests.serving.batching.harness import FakeClock, Harness


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Request it before ``make``, so that the batchers stop before the real clock is back."""
    fake = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


@pytest.fixture
async def make() -> AsyncIterator[Harness]:
    harness = Harness()
    yield harness
    for batcher in harness.batchers:
        await batcher.stop(drain=False)
