"""A version switch replica by replica (issue 21), in process over fake elastic runners on a
fake cluster of a few replica slots: where the new version's replicas do not fit beside the old
one's, the new starts with one, the two swap a replica at a time (never fewer than N-1 serve,
nothing dropped), the old is retired at the end; a step that fails turns the switch back; with
one replica, or room for both, the switch is the one-step hand-over."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.elastic.steps import Scaler, hold, release
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from serving.version.served import ServedModel
from shards.pipeline.health import Health
from tests.fakes import WAIT_S, make_rows, spawn
from tests.serving.elastic.test_scaling_loop import ElasticFake, elastic_settings, served, until
from tests.serving.repository.test_repository_switch import Load, TaggedRunner, add_version, index
from tests.serving.served_repository import serve_repository

# Batches each add or remove of a replica spans: every step happens under traffic.
STEP_BATCHES = 3


@dataclass
class Cluster:
    """``slots`` replicas fit at once; a replica holds its slot from placed until removed."""

    slots: int
    runners: list[Versioned] = field(default_factory=list)
    batches: int = 0
    fewest_serving: int | None = None  # once every runner it made has served
    answered: asyncio.Condition = field(default_factory=asyncio.Condition)

    def used(self) -> int:
        return sum(len(r.states) for r in self.runners if not r.closed)

    def serving(self) -> int:
        return sum(r.states.count("healthy") for r in self.runners if not r.closed)

    def note(self) -> None:
        n = self.serving()
        self.fewest_serving = n if self.fewest_serving is None else min(n, self.fewest_serving)

    async def fits(self, model: ServedModel, count: int) -> bool:
        return self.slots - self.used() >= count

    async def traffic(self, n: int) -> None:
        """Until ``n`` more batches have been answered (by any version)."""
        async with self.answered:
            target = self.batches + n
            await self.answered.wait_for(lambda: self.batches >= target)


class Versioned(TaggedRunner):
    """An elastic fake of one version on the ``Cluster``: answers its version; an add is
    given up where the cluster has no slot free, or where ``refuse_adds`` is set."""

    def __init__(self, tag: int, replicas: int, cluster: Cluster) -> None:
        super().__init__(tag)
        self.cluster = cluster
        self.states = ["healthy"] * replicas
        self.refuse_adds = False
        self.adds = self.removes = 0

    @property  # type: ignore[override]
    def replicas(self) -> int:
        return len(self.states)

    def health(self) -> Health:
        return Health(len(self.states), self.states.count("healthy"), tuple(self.states))

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert "healthy" in self.states, "a batch reached a version with no healthy replica"
        out = await super().run_batch(inputs)
        async with self.cluster.answered:
            self.cluster.batches += 1
            self.cluster.answered.notify_all()
        return out

    async def add_replica(self, pending_timeout_s: float) -> bool:
        self.adds += 1
        if self.refuse_adds or self.cluster.used() >= self.cluster.slots:
            return False  # as a replica pending past its timeout
        self.states.append("starting")
        await self.cluster.traffic(STEP_BATCHES)
        self.states[self.states.index("starting")] = "healthy"
        self.cluster.note()
        return True

    async def remove_replica(self, drain_timeout_s: float) -> bool:
        if len(self.states) <= 1:
            return False
        self.removes += 1
        at = self.states.index("healthy")
        self.states[at] = "draining"
        self.cluster.note()
        await self.cluster.traffic(STEP_BATCHES)
        del self.states[at]
        return True

    async def close(self) -> None:
        await super().close()
        self.cluster.note()


@dataclass
class Fleet:
    """The runner factory: a ``Versioned`` per version of model ``m``, with the replicas its
    settings ask; a load that does not fit fails."""

    cluster: Cluster
    made: dict[int, list[Versioned]] = field(default_factory=dict)
    refuse_adds: set[int] = field(default_factory=set)
    broken: set[int] = field(default_factory=set)  # versions whose load fails

    async def __call__(self, settings: Settings) -> Versioned:
        v = int(Path(str(settings.model)).parent.name)
        if v in self.broken:
            raise RuntimeError(f"version {v} is broken")
        if self.cluster.slots - self.cluster.used() < settings.replicas:
            raise RuntimeError(f"no room for {settings.replicas} replica(s)")
        runner = Versioned(v, settings.replicas, self.cluster)
        runner.refuse_adds = v in self.refuse_adds
        self.made.setdefault(v, []).append(runner)
        self.cluster.runners.append(runner)
        return runner


@contextlib.asynccontextmanager
async def switch_under_load(
    tmp_path: Path, fleet: Fleet, replicas: int, fits: Any = None
) -> AsyncIterator[tuple[ServerState, Load]]:
    """Serve version 1 of ``m``, add version 2 under four clients and wait until the switch
    is over (version 1 gone, or version 2 failed); the state and the clients' answers, while
    the server still runs."""
    add_version(tmp_path, 1)
    async with serve_repository(tmp_path, fleet, max_batch_size=2, replicas=replicas) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        state.repository.rolling.fits = fits or fleet.cluster.fits
        load = Load(client)
        clients = [asyncio.create_task(load.one_client()) for _ in range(4)]
        try:
            await load.more(8)
            fleet.cluster.fewest_serving = None
            add_version(tmp_path, 2)
            await state.repository.poll_once()
            await until(lambda: list(state.models["m"]) == ["2"] or bool(_failed(state)))
            # The switch's last step (its last replica added) may follow the old's retire by a
            # tick: wait for the switch to end, not only for the old to go.
            await until(lambda: not state.repository.rolling.switching("m"))  # type: ignore[union-attr]
            await load.more(8)
        finally:
            load.stopping = True
            await asyncio.gather(*clients)
        yield state, load


def _failed(state: ServerState) -> str | None:
    model = state.models["m"].get("2")
    return model.reason if model is not None and model.state is VersionState.FAILED else None


def codes(load: Load) -> list[int]:
    return [code for _, code, _ in load.answers if code != 200]


async def test_a_switch_that_does_not_fit_goes_replica_by_replica(tmp_path: Path) -> None:
    fleet = Fleet(Cluster(slots=3))  # version 1's three replicas fill the cluster
    async with switch_under_load(tmp_path, fleet, replicas=3) as (state, load):
        old, new = fleet.made[1][0], fleet.made[2][0]
        assert codes(load) == []  # nothing dropped
        assert fleet.cluster.fewest_serving == 2  # never fewer than N-1
        assert len(fleet.made[2]) == 1 and new.states == ["healthy"] * 3
        assert (old.removes, new.adds) == (2, 2)  # 3 -> 1, then its last one retired
        assert old.closed and not new.closed
        assert list(state.models["m"]) == ["2"] and index(state)["m/2"] == ("READY", "")
        assert {1.0, 2.0} <= set(load.tags())  # both answered while they shared the requests
        assert set(load.tags()[-8:]) == {2.0}
        assert "m" not in state.traffic
        batcher = state.models["m"]["2"].batcher
        assert batcher is not None and batcher.settings.pipeline_depth == 3  # limits for 3 replicas


async def test_a_new_version_that_fails_mid_way_gives_the_old_its_replicas_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="shardserve")
    fleet = Fleet(Cluster(slots=3), refuse_adds={2})
    async with switch_under_load(tmp_path, fleet, replicas=3) as (state, load):
        old, new = fleet.made[1][0], fleet.made[2][0]
        assert codes(load) == []
        assert fleet.cluster.fewest_serving == 2
        assert old.states == ["healthy"] * 3 and not old.closed  # back at N
        assert new.closed and new.adds == 1
        state_2, reason = index(state)["m/2"]
        assert state_2 == "UNAVAILABLE" and "\n" not in reason
        assert "replacing version 1 replica by replica: its replica 2 of 3 was not placed" in reason
        assert reason.endswith("version 1 serves with 3 replica(s)")
        assert index(state)["m/1"] == ("READY", "")
        assert set(load.tags()[-8:]) == {1.0}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("replica by replica" in w and "version 2" in w for w in warnings), warnings
        assert state.repository is not None
        await state.repository.poll_once()  # its files did not change: not tried again
        assert len(fleet.made[2]) == 1


async def test_a_new_version_that_fails_to_load_gives_the_old_its_replica_back(
    tmp_path: Path,
) -> None:
    fleet = Fleet(Cluster(slots=3), broken={2})
    async with switch_under_load(tmp_path, fleet, replicas=3) as (state, load):
        old = fleet.made[1][0]
        assert codes(load) == [] and fleet.cluster.fewest_serving == 2
        assert old.removes == 1 and old.adds == 1 and old.states == ["healthy"] * 3
        assert index(state)["m/2"] == (
            "UNAVAILABLE",
            "model failed to load: RuntimeError: version 2 is broken",
        )


async def test_one_replica_hands_over_once_the_new_one_is_ready(tmp_path: Path) -> None:
    asked: list[int] = []

    async def never(model: ServedModel, count: int) -> bool:
        asked.append(count)
        return False

    fleet = Fleet(Cluster(slots=2))
    async with switch_under_load(tmp_path, fleet, replicas=1, fits=never) as (state, load):
        old, new = fleet.made[1][0], fleet.made[2][0]
        assert codes(load) == [] and asked == []
        assert old.closed and old.removes == 0 and new.adds == 0
        assert list(state.models["m"]) == ["2"]


async def test_a_switch_that_fits_moves_at_once(tmp_path: Path) -> None:
    fleet = Fleet(Cluster(slots=6))
    async with switch_under_load(tmp_path, fleet, replicas=3) as (state, load):
        old, new = fleet.made[1][0], fleet.made[2][0]
        assert codes(load) == []
        assert new.states == ["healthy"] * 3 and (new.adds, old.removes) == (0, 0)
        assert old.closed and list(state.models["m"]) == ["2"]


async def test_a_held_version_is_not_scaled_until_released() -> None:
    gate = asyncio.Event()
    gate.set()  # the warm-up batch goes through
    runner = ElasticFake(gate=gate)
    model = await served(elastic_settings(), runner)
    gate.clear()
    await model.stop_jobs(WAIT_S)  # its own loop ends: this test ticks one
    batcher = model.require_batcher()
    # Batches hang: 2 in flight, rows queue behind them: a backlog that asks for a replica.
    requests = [await spawn(batcher.submit(make_rows(4, start=i * 4))) for i in range(4)]
    await runner.wait_started(3)
    scaler = Scaler(model, runner, batcher)
    hold(model, "version 2 replaces version 1 replica by replica")
    try:
        held = scaler.tick(0.0)
        assert (held.direction, held.reason) == ("", "held") and not scaler.adds
        release(model)
        assert scaler.tick(1.0).direction == "up"
        runner.place.set()
        await until(lambda: not scaler.adds)
        assert runner.states == ["healthy", "healthy"]
    finally:
        scaler.cancel()
        gate.set()
        await asyncio.gather(*requests)
