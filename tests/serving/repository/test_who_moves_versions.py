"""Only the reconciler moves a version: a served version's ``start``, ``retire``, ``end_retire``
and ``close`` are called from ``serving.repository`` (the reconciler and the switch step it takes)
or from the version itself (a retire closes it), never by a route, the canary or the elastic part.
The process stop is the one other caller: it drains and closes every version itself once the
reconciler has stopped (a SIGTERM is not a version move)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serving.version.served import ServedModel
from tests.serving.repository.test_manager import Runners, managed, settled, version

MOVES = ("start", "retire", "end_retire", "close")
MOVERS = ("serving.repository.", "serving.version.served")


@pytest.fixture
def callers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, str]]]:
    """Every call of a move of a served version, by (move, calling module)."""
    seen: Counter[tuple[str, str]] = Counter()
    for move in MOVES:
        original = getattr(ServedModel, move)

        def recorded(
            *args: Any, _move: str = move, _original: Callable[..., Any] = original
        ) -> Any:
            seen[(_move, sys._getframe(1).f_globals["__name__"])] += 1
            return _original(*args)

        monkeypatch.setattr(ServedModel, move, recorded)
    yield seen


async def test_only_the_reconciler_loads_switches_and_unloads_versions(
    tmp_path: Path, callers: Counter[tuple[str, str]]
) -> None:
    version(tmp_path, "m", 1)
    runners = Runners()
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        version(tmp_path, "m", 2)
        await repository.poll_once()  # version 2 loads, version 1 is retired
        await settled(state)
        await repository.unload("m")
        await repository.load("m")
        await settled(state)
    moves = {move for move, _ in callers}
    assert moves >= {"start", "retire", "close"}  # the scenario took each kind of move
    # (the test's own harness closes what is left at its end: only serving's callers count)
    strays = {
        key: n
        for key, n in callers.items()
        if key[1].startswith("serving.") and not key[1].startswith(MOVERS)
    }
    assert not strays, f"a version moved by something other than the reconciler: {strays}"


def test_the_check_sees_a_stray_caller(callers: Counter[tuple[str, str]]) -> None:
    # The recorder itself: a call from this test module is recorded under its name.
    model = ServedModel.__new__(ServedModel)
    with pytest.raises(AttributeError):  # a bare instance: the call fails after it is recorded
        model.end_retire()
    assert callers == Counter({("end_retire", __name__): 1})
