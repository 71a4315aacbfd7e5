"""Switching versions without a dropped request (issue 21), in process over fake runners that
tag every answer with their version: the new version loads and warms up while the old one
serves, traffic moves once it is READY, then the old one drains and ends; a new version that
fails keeps the old one serving (the index says why) until its files change; under `latest`
n > 1 a version that drops out of the selection is retired only once its replacement is READY."""

from __future__ import annotations

import asyncio
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serving.server.state import ServerState
from serving.settings.config import Settings
from tests.fakes import WAIT_S, FakeRunner
from tests.serving.repository.test_manager import _until
from tests.serving.served_app import row
from tests.serving.served_repository import serve_repository, write_repository

PREDICT = "/v1/models/m:predict"


class TaggedRunner(FakeRunner):
    """Answers ``[version, version]`` for every row: the client sees who answered."""

    def __init__(self, tag: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag

    async def run_batch(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = await super().run_batch(inputs)
        return {"y": np.full_like(out["y"], float(self.tag))}


@dataclass
class Versions:
    """The runner factory: a ``TaggedRunner`` per version of model ``m``; a version's load
    waits on its ``loading`` event, if it has one; ``failing`` makes its warm-up fail."""

    made: dict[int, list[TaggedRunner]] = field(default_factory=dict)
    loading: dict[int, asyncio.Event] = field(default_factory=dict)
    failing: dict[int, BaseException] = field(default_factory=dict)

    async def __call__(self, settings: Settings) -> TaggedRunner:
        v = int(Path(str(settings.model)).parent.name)
        if v in self.loading:
            await self.loading[v].wait()
        runner = TaggedRunner(v, fail_with=self.failing.get(v))
        self.made.setdefault(v, []).append(runner)
        return runner


@dataclass
class Load:
    """Clients sending requests that name no version, back to back, until stopped."""

    client: httpx.AsyncClient
    answers: list[tuple[float, int, float | None]] = field(default_factory=list)  # sent, code, tag
    stopping: bool = False

    async def one_client(self) -> None:
        while not self.stopping:
            sent = time.monotonic()
            reply = await self.client.post(PREDICT, json={"instances": [row(1)]})
            tag = reply.json()["predictions"][0][0] if reply.status_code == 200 else None
            self.answers.append((sent, reply.status_code, tag))
            await asyncio.sleep(0)  # a refusal may come back without yielding to the loop

    def tags(self, since: float = 0.0) -> list[float | None]:
        return [tag for sent, _, tag in self.answers if sent >= since]

    async def more(self, n: int) -> None:
        """Until ``n`` more answers have come back."""
        target = len(self.answers) + n
        await _until(lambda: len(self.answers) >= target)


def index(state: ServerState) -> dict[str, tuple[str, str]]:
    assert state.repository is not None
    return {
        f"{e['name']}/{e['version']}": (e["state"], e["reason"]) for e in state.repository.index()
    }


def add_version(root: Path, v: int, config: str = "") -> None:
    write_repository(root, {"m": ([v], "")})
    if config:
        (root / "m" / "config.toml").write_text(config)


async def test_a_switch_under_load_drops_no_request_and_the_old_version_answers_none_after(
    tmp_path: Path,
) -> None:
    add_version(tmp_path, 1, "[labels]\nstable = 2\n")
    versions = Versions()
    slow = versions.loading[2] = asyncio.Event()
    async with serve_repository(tmp_path, versions, max_batch_size=2) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        load = Load(client)
        clients = [asyncio.create_task(load.one_client()) for _ in range(4)]
        try:
            await load.more(8)
            rows = state.model("m", "1").require_batcher().settings.max_queue_rows
            add_version(tmp_path, 2)
            await state.repository.poll_once()
            # Version 2 loads (held in its load) while version 1 answers everything, its queue
            # deeper meanwhile (a load's CPU stalls it on a small machine: switch_queue).
            assert index(state)["m/2"][0] == "LOADING"
            assert state.model("m", "1").require_batcher().settings.max_queue_rows == 8 * rows
            loading_from = time.monotonic()
            await load.more(20)
            assert state.model("m").version == "1"  # a LOADING higher version is never picked
            assert "m" not in state.labels  # stable = 2 waits for version 2 to be READY
            slow.set()
            await _until(lambda: list(state.models["m"]) == ["2"])
            switched = time.monotonic()
            old = versions.made[1][0]
            answered_by_old = old.calls_finished
            await load.more(20)
        finally:
            load.stopping = True
            await asyncio.wait_for(asyncio.gather(*clients), WAIT_S)
        assert [code for _, code, _ in load.answers if code != 200] == []  # none dropped
        assert set(load.tags(loading_from)) >= {1.0, 2.0}
        assert set(load.tags(switched)) == {2.0}  # nothing sent after the switch reaches 1
        assert old.closed and old.calls_finished == answered_by_old
        assert state.model("m", "2").require_batcher().settings.max_queue_rows == rows
        assert state.labels == {"m": {"stable": "2"}}
        assert index(state) == {
            "m/1": ("UNAVAILABLE", "not selected by its version policy (latest 1)"),
            "m/2": ("READY", ""),
        }
        gone = await client.post("/v1/models/m/versions/1:predict", json={"instances": [row(1)]})
        assert gone.status_code == 404, gone.text
        assert "has no version '1'; its versions: ['2']" in gone.json()["error"]


async def test_a_new_version_that_fails_keeps_the_old_one_until_its_files_change(
    tmp_path: Path,
) -> None:
    add_version(tmp_path, 1)
    versions = Versions()
    versions.failing[2] = RuntimeError("the warm-up batch broke")
    async with serve_repository(tmp_path, versions) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        start = state.model("m", "1").require_batcher().settings
        add_version(tmp_path, 2)
        await state.repository.poll_once()
        await _until(lambda: index(state)["m/2"][0] == "UNAVAILABLE")
        why = "model failed to load: RuntimeError: the warm-up batch broke"
        assert index(state) == {"m/1": ("READY", ""), "m/2": ("UNAVAILABLE", why)}
        await _until(lambda: state.model("m", "1").require_batcher().settings == start)
        reply = await client.post(PREDICT, json={"instances": [row(1)]})
        assert (reply.status_code, reply.json()["predictions"][0][0]) == (200, 1.0)
        await _until(lambda: versions.made[2][0].closed)  # the failed one's actors end
        await state.repository.poll_once()  # its files did not change: not tried again
        assert len(versions.made[2]) == 1 and index(state)["m/2"] == ("UNAVAILABLE", why)

        del versions.failing[2]
        with zipfile.ZipFile(tmp_path / "m" / "2" / "m.keras", "a") as archive:
            archive.writestr("fixed.txt", "its files change")  # so does its fingerprint
        await state.repository.poll_once()
        await _until(lambda: list(state.models["m"]) == ["2"])
        assert len(versions.made[2]) == 2 and versions.made[1][0].closed
        reply = await client.post(PREDICT, json={"instances": [row(1)]})
        assert (reply.status_code, reply.json()["predictions"][0][0]) == (200, 2.0)


async def test_under_latest_two_the_version_that_drops_out_serves_until_the_new_is_ready(
    tmp_path: Path,
) -> None:
    add_version(tmp_path, 1)
    add_version(tmp_path, 2, '[versions]\npolicy = "latest"\nn = 2\n')
    versions = Versions()
    slow = versions.loading[3] = asyncio.Event()
    async with serve_repository(tmp_path, versions) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        add_version(tmp_path, 3)
        await state.repository.poll_once()
        assert {v: s for v, (s, _) in index(state).items()} == {
            "m/1": "READY",
            "m/2": "READY",
            "m/3": "LOADING",
        }
        named = await client.post("/v1/models/m/versions/1:predict", json={"instances": [row(1)]})
        assert (named.status_code, named.json()["predictions"][0][0]) == (200, 1.0)
        slow.set()
        await _until(lambda: sorted(state.models["m"]) == ["2", "3"])
        assert versions.made[1][0].closed


async def test_the_new_version_holds_the_deeper_queue_until_the_old_one_has_drained(
    tmp_path: Path,
) -> None:
    """The old version's backlog runs on the cores the new one's first batches need: the new
    version takes the traffic with the deeper queue, and both narrow only once the old version
    has answered what it held (``switch_queue``)."""
    add_version(tmp_path, 1)
    versions = Versions()
    loading = versions.loading[2] = asyncio.Event()
    async with serve_repository(tmp_path, versions, max_batch_size=2) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        rows = state.model("m", "1").require_batcher().settings.max_queue_rows
        held = versions.made[1][0].gate = asyncio.Event()  # version 1's batches hang from now
        backlog = [
            asyncio.create_task(client.post(PREDICT, json={"instances": [row(1)]}))
            for _ in range(6)
        ]
        await _until(lambda: versions.made[1][0].calls_started >= 2)
        add_version(tmp_path, 2)
        await state.repository.poll_once()
        await _until(lambda: index(state)["m/2"][0] == "LOADING")
        loading.set()
        await _until(lambda: index(state)["m/2"][0] == "READY")
        reply = await client.post(PREDICT, json={"instances": [row(1)]})
        assert (reply.status_code, reply.json()["predictions"][0][0]) == (200, 2.0)
        # Version 1 drains its backlog meanwhile: version 2 serves with the deeper queue.
        assert "1" in state.models["m"]
        assert state.model("m", "2").require_batcher().settings.max_queue_rows == 8 * rows
        held.set()
        answers = await asyncio.wait_for(asyncio.gather(*backlog), WAIT_S)
        assert [a.status_code for a in answers] == [200] * 6
        assert {a.json()["predictions"][0][0] for a in answers} == {1.0}
        await _until(lambda: list(state.models["m"]) == ["2"])
        await _until(
            lambda: state.model("m", "2").require_batcher().settings.max_queue_rows == rows
        )
