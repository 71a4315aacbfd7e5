"""Only the reconciler moves a version: a served version's ``start``, ``retire``, ``end_retire``,
``close`` and ``stop_accepting`` are called from ``serving.repository`` (the reconciler and the
switch step it takes: the server's stop refuses through the reconciler's step) or from the version
itself (a retire closes it), never by a route, the canary or the elastic part. The process stop is
the one other caller of ``close``: it drains and closes every version itself once the reconciler
has stopped (a SIGTERM is not a version move).

And each knob the reconciler turns has one writer: a version's batching limits are written only by
``serving.elastic.limits.apply_limits`` (the operator's PUT, a switch's widening and the replicas
that serve are its sources), its replica count only by ``serving.elastic.count``'s actuator (the
scaling loop's steps and a switch's steps call it), and only the reconciler refuses a version's
new requests."""

from __future__ import annotations

import ast
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from serving.batching.batcher import Batcher
from serving.version.served import ServedModel
from tests.serving.repository.test_manager import Runners, managed, settled, version

MOVES = ("start", "retire", "end_retire", "close", "stop_accepting")
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


@pytest.fixture
def limit_writers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every change of a batcher's settings, by calling module."""
    seen: Counter[str] = Counter()
    original = Batcher.reconfigure

    def recorded(self: Batcher, **changes: Any) -> Any:
        seen[sys._getframe(1).f_globals["__name__"]] += 1
        return original(self, **changes)

    monkeypatch.setattr(Batcher, "reconfigure", recorded)
    yield seen


async def test_only_the_reconciler_loads_switches_and_unloads_versions(
    tmp_path: Path, callers: Counter[tuple[str, str]], limit_writers: Counter[str]
) -> None:
    version(tmp_path, "m", 1)
    runners = Runners()
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        version(tmp_path, "m", 2)
        await repository.poll_once()  # version 2 loads (version 1's queue widens), 1 retires
        await settled(state)
        await repository.unload("m")
        await repository.load("m")
        await settled(state)
        state.begin_stop()  # the server's stop: every version refuses
    moves = {move for move, _ in callers}
    # the scenario took each kind of move
    assert moves >= {"start", "retire", "close", "stop_accepting"}
    assert ("stop_accepting", "serving.repository.reconciler") in callers
    # A switch widened and narrowed a queue: through the one writer of the limits.
    assert limit_writers and set(limit_writers) == {"serving.elastic.limits"}, limit_writers
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


# Each actuator of a served version and the modules that may call it: a new writer fails here.
# (``Rollout.reconfigure``, a canary's rules read again, is not a batcher's: its receiver is
# named ``rollout``.)
ACTUATORS = {
    "reconfigure": {"serving/elastic/limits.py"},  # a batcher's limits
    "add_replica": {"serving/elastic/count.py"},  # a version's replica count
    "remove_replica": {"serving/elastic/count.py"},
    "stop_accepting": {"serving/repository/reconciler.py", "serving/version/served.py"},
}


def writers() -> dict[str, set[str]]:
    """Where in ``serving/`` each actuator is called, by file."""
    root = Path(__file__).resolve().parents[3]
    found: defaultdict[str, set[str]] = defaultdict(set)
    for path in sorted((root / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = node.func.value
            if isinstance(receiver, ast.Name) and receiver.id == "rollout":
                continue
            if node.func.attr in ACTUATORS:
                found[node.func.attr].add(path.relative_to(root).as_posix())
    return dict(found)


def test_each_knob_the_reconciler_turns_has_one_writer() -> None:
    assert writers() == ACTUATORS
