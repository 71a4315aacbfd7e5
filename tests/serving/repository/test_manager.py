"""The repository manager over a repository on disk, every version on a fake runner: what each
version policy serves, labels, load and unload through the API (an unload holds against
polling), polling that adds and removes versions (a version removed answers what it holds
first, once what replaces it is READY), a broken version refused with its reason while the
others serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zipfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from serving.errors import (
    DeadlineExceededError,
    InvalidInputError,
    NotFoundError,
    NotReadyError,
)
from serving.repository.manager import Repository
from serving.repository.source import Directory
from serving.server.app import create_app
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from tests.fakes import WAIT_S, FakeRunner, make_rows
from tests.metrics_text import metric
from tests.serving.served_app import row

UNLOADED = "unloaded through the repository API"


def version(root: Path, name: str, v: int) -> Path:
    """A complete version directory: a stand-in bundle (its manifest is what marks it whole)."""
    path = root / name / str(v)
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    return path


class Runners:
    """A fake runner per (model, version), made when the manager loads it."""

    def __init__(self) -> None:
        self.made: dict[tuple[str, str], FakeRunner] = {}
        self.failing: dict[tuple[str, str], BaseException] = {}
        self.gates: dict[tuple[str, str], asyncio.Event] = {}

    async def __call__(self, settings: Settings) -> FakeRunner:
        key = (str(settings.model_name), Path(settings.model).name)
        runner = FakeRunner(gate=self.gates.get(key), fail_with=self.failing.get(key))
        self.made[key] = runner
        return runner


@contextlib.asynccontextmanager
async def managed(
    root: Path, runners: Runners, poll_s: float = 0.0, **more: float
) -> AsyncIterator[Repository]:
    values = {"batch_timeout_ms": 0.0, "stop_timeout_s": 5.0, "repository_poll_s": poll_s, **more}
    settings = Settings(model_repository=root, **values)
    state = ServerState(settings)
    repository = Repository(state, settings, runners)
    await repository.start()
    try:
        await settled(state)
        yield repository
    finally:
        await repository.stop(1.0)
        for model in state.served():
            await model.stop_jobs(1.0)
            await model.close(1.0)


async def settled(state: ServerState) -> None:
    await asyncio.wait_for(asyncio.gather(*(m.wait_load() for m in state.served())), WAIT_S)


def index(repository: Repository) -> dict[str, tuple[str, str]]:
    return {f"{e['name']}/{e['version']}": (e["state"], e["reason"]) for e in repository.index()}


async def test_each_policy_serves_its_versions_and_the_index_says_why_others_are_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for v in (1, 2, 3):
        version(tmp_path, "latest", v)
        version(tmp_path, "every", v)
        version(tmp_path, "some", v)
    (tmp_path / "every" / "config.toml").write_text('[versions]\npolicy = "all"\n')
    (tmp_path / "some" / "config.toml").write_text(
        '[versions]\npolicy = "specific"\nversions = [1, 3]\n[labels]\nstable = 1\nnext = 2\n'
    )
    version(tmp_path, "broken", 1)
    (tmp_path / "broken" / "config.toml").write_text("max_batch = 8\n")
    (tmp_path / "empty").mkdir()
    runners = Runners()
    runners.failing[("latest", "3")] = RuntimeError("cannot read the weights")
    planned: list[list[str]] = []

    def plan(versions: list[Settings]) -> int:
        assert not runners.made  # before any load could start a private Ray
        planned.append(sorted(f"{s.model_name}/{Path(s.model).name}" for s in versions))
        return 8

    monkeypatch.setattr("serving.repository.manager.plan_private_ray", plan)
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        # The private Ray's CPU count is planned for every version the policies select.
        assert planned == [["every/1", "every/2", "every/3", "latest/3", "some/1", "some/3"]]
        assert {name: sorted(vs) for name, vs in state.models.items()} == {
            "every": ["1", "2", "3"],
            "latest": ["3"],
            "some": ["1", "3"],
        }
        seen = index(repository)
        assert seen["every/2"] == ("READY", "")
        assert seen["latest/2"] == ("UNAVAILABLE", "not selected by its version policy (latest 1)")
        assert seen["latest/3"] == (
            "UNAVAILABLE",
            "model failed to load: RuntimeError: cannot read the weights",
        )
        assert seen["some/2"] == (
            "UNAVAILABLE",
            "not selected by its version policy (specific [1, 3])",
        )
        state_of_broken, why = seen["broken/1"]
        assert state_of_broken == "UNAVAILABLE"
        assert why.startswith("broken/config.toml: unknown key 'max_batch'"), why
        assert seen["empty/"] == ("UNAVAILABLE", "no complete version in the repository")
        assert [e["name"] + "/" + e["version"] for e in repository.index(ready_only=True)] == [
            "every/1",
            "every/2",
            "every/3",
            "some/1",
            "some/3",
        ]
        # A label points only at a loaded version: "next" (version 2, not selected) is unset.
        assert state.labels == {"some": {"stable": "1"}}
        assert state.model("some", label="stable").version == "1"
        assert state.model("some").version == "3"
        # The failed version's actors end at once; the server is ready with the others.
        await _until(lambda: runners.made[("latest", "3")].closed)
        assert state.not_ready_reason() is None


async def test_unload_drains_and_holds_against_polling_until_a_load(tmp_path: Path) -> None:
    version(tmp_path, "a", 1)
    version(tmp_path, "b", 1)
    runners = Runners()
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        first = runners.made[("a", "1")]
        await repository.unload("a")
        assert first.closed
        assert "a" not in state.models
        assert index(repository)["a/1"] == ("UNAVAILABLE", UNLOADED)
        with pytest.raises(NotFoundError, match=rf"model 'a' is not served \({UNLOADED}\)"):
            state.model("a")
        await repository.poll_once()  # the hold: polling does not bring it back
        assert "a" not in state.models
        assert state.model("b").not_ready_reason() is None  # the other serves on
        version(tmp_path, "a", 2)  # a load reads the model's directory again
        await repository.load("a")
        assert list(state.models["a"]) == ["2"]
        assert state.model("a").not_ready_reason() is None
        assert index(repository)["a/1"] == (
            "UNAVAILABLE",
            "not selected by its version policy (latest 1)",
        )
        with pytest.raises(NotFoundError, match=r"model 'c' is not in the model repository"):
            await repository.load("c")
        with pytest.raises(NotFoundError, match=r"model 'c' is not in the model repository"):
            await repository.unload("c")


async def test_a_load_through_the_api_retries_a_failed_version_and_says_why_it_failed(
    tmp_path: Path,
) -> None:
    version(tmp_path, "a", 1)
    runners = Runners()
    runners.failing[("a", "1")] = RuntimeError("out of memory")
    async with managed(tmp_path, runners) as repository:
        await repository.poll_once()  # its files did not change: polling leaves it failed
        assert runners.made[("a", "1")].closed
        failed_once = runners.made[("a", "1")]
        with pytest.raises(NotReadyError) as refused:
            await repository.load("a")
        assert refused.value.message == (
            "model 'a' version 1 failed to load: RuntimeError: out of memory"
        )
        assert runners.made[("a", "1")] is not failed_once  # loaded again
        del runners.failing[("a", "1")]
        await repository.load("a")
        assert index(repository)["a/1"] == ("READY", "")
        (tmp_path / "a" / "config.toml").write_text('[versions]\npolicy = "newest"\n')
        with pytest.raises(InvalidInputError, match=r"a/config.toml: \[versions\] policy must"):
            await repository.load("a")
        assert index(repository)["a/1"] == ("READY", "")  # a broken config unloads nothing


async def test_polling_loads_a_new_version_and_the_removed_one_answers_what_it_holds(
    tmp_path: Path,
) -> None:
    version(tmp_path, "m", 1)
    runners = Runners()
    gate = runners.gates[("m", "1")] = asyncio.Event()
    gate.set()  # its warm-up runs; then requests wait on the gate
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        old = state.model("m", "1")
        gate.clear()
        held = asyncio.create_task(
            old.require_batcher().submit(make_rows(1), deadline=time.monotonic() + WAIT_S)
        )
        await runners.made[("m", "1")].wait_started(2)  # in flight on version 1

        (tmp_path / "m" / ".2.incoming").mkdir()  # hidden: a copy not finished is not read
        version(tmp_path, "m", 2)
        poll = asyncio.create_task(repository.poll_once())
        await _until(lambda: old.state in (VersionState.DRAINING, VersionState.RETIRED))
        with pytest.raises(NotReadyError, match=r"version 1 is being unloaded \(no longer sel"):
            old.require_batcher()
        assert not held.done()
        gate.set()
        answer = await asyncio.wait_for(held, WAIT_S)  # answered before its actors end
        assert answer["y"].shape == (1, 2)
        await asyncio.wait_for(poll, WAIT_S)
        await _until(lambda: list(state.models["m"]) == ["2"])  # once drained and closed
        assert runners.made[("m", "1")].closed
        assert state.model("m").not_ready_reason() is None

        (tmp_path / "m" / "2" / "manifest.json").unlink()  # incomplete now: gone from the disk
        await repository.poll_once()
        # Version 1 is the latest again; version 2 serves until it is READY, then goes.
        await _until(lambda: list(state.models["m"]) == ["1"])
        assert runners.made[("m", "2")].closed
        assert index(repository) == {"m/1": ("READY", "")}


async def test_the_poll_loop_loads_a_model_that_appears_and_unloads_one_removed(
    tmp_path: Path,
) -> None:
    version(tmp_path, "a", 1)
    runners = Runners()
    async with managed(tmp_path, runners, poll_s=0.01) as repository:
        version(tmp_path, "b", 1)
        await _until(lambda: ("b", "1") in runners.made)
        await settled(repository.state)
        assert index(repository) == {"a/1": ("READY", ""), "b/1": ("READY", "")}
        # Moved out in one step: a poll between an unlink and an rmdir would rightly list "a"
        # with no complete version for a moment.
        (tmp_path / "a").rename(tmp_path.parent / f"{tmp_path.name}-a-removed")
        await _until(lambda: runners.made[("a", "1")].closed and "a" not in repository.state.models)
        assert sorted(index(repository)) == ["b/1"]


async def test_an_app_over_two_models_asks_predict_to_name_one_and_its_stop_closes_both(
    tmp_path: Path,
) -> None:
    version(tmp_path, "a", 1)
    version(tmp_path, "b", 1)
    settings = Settings(model_repository=tmp_path, batch_timeout_ms=0.0)
    runners = Runners()
    app = create_app(settings, runners)
    async with LifespanManager(app) as manager:
        await settled(app.state.shardserve)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            ready = await client.get("/readyz")
            default = await client.post("/predict", json={"instances": [row(1)]})
            named = await client.post("/v1/models/b:predict", json={"instances": [row(1)]})
    assert (ready.status_code, ready.json()) == (200, {"status": "ready", "model": "a"})
    assert default.status_code == 400
    assert "several models ('a', 'b') and none is the default" in default.json()["error"]
    assert named.status_code == 200, named.text
    assert all(r.closed for r in runners.made.values()) and len(runners.made) == 2  # the stop


async def test_a_retire_answers_what_it_admitted_past_the_stop_budget(tmp_path: Path) -> None:
    version(tmp_path, "a", 1)
    runners = Runners()
    gate = runners.gates[("a", "1")] = asyncio.Event()
    gate.set()  # its warm-up passes
    async with managed(tmp_path, runners, stop_timeout_s=0.2) as repository:
        model = repository.state.model("a", "1")
        gate.clear()
        # A deadline far past the stop budget (0.2 s), as the default 30 s is past the default 25.
        held = asyncio.create_task(
            model.require_batcher().submit(make_rows(1), deadline=time.monotonic() + WAIT_S)
        )
        await runners.made[("a", "1")].wait_started(2)  # in flight
        unload = asyncio.create_task(repository.unload("a"))
        await _until(lambda: model.state in (VersionState.DRAINING, VersionState.RETIRED))
        # Past the whole stop budget: a drain bounded by it has failed the request by now.
        await asyncio.sleep(0.5)
        assert not held.done() and not unload.done()
        gate.set()
        answer = await asyncio.wait_for(held, WAIT_S)
        await asyncio.wait_for(unload, WAIT_S)
        assert answer["y"].shape == (1, 2)
        assert runners.made[("a", "1")].closed
        assert "a" not in repository.state.models


async def test_a_retire_waits_no_longer_than_the_deadlines_it_admitted(tmp_path: Path) -> None:
    version(tmp_path, "a", 1)
    runners = Runners()
    gate = runners.gates[("a", "1")] = asyncio.Event()
    gate.set()
    async with managed(tmp_path, runners, request_timeout_ms=300.0) as repository:
        model = repository.state.model("a", "1")
        gate.clear()  # its batch hangs for good
        held = asyncio.create_task(
            model.require_batcher().submit(make_rows(1), deadline=time.monotonic() + 0.3)
        )
        await runners.made[("a", "1")].wait_started(2)
        await asyncio.wait_for(repository.unload("a"), WAIT_S)  # ends: no wait for the hang
        with pytest.raises(DeadlineExceededError):  # its own deadline's answer, not a 503
            await held
        assert runners.made[("a", "1")].closed


async def test_a_settle_that_raises_is_logged_counted_and_its_hand_over_done_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("serving.supervisor.RESTART_S", (0.0, 0.0))
    caplog.set_level(logging.ERROR, logger="shardserve")
    version(tmp_path, "m", 1)
    runners = Runners()
    async with managed(tmp_path, runners) as repository:
        state = repository.state
        old = state.model("m", "1")
        own_rows = old.require_batcher().settings.max_queue_rows
        loads = runners.gates[("m", "2")] = asyncio.Event()  # version 2's warm-up waits
        version(tmp_path, "m", 2)
        await repository.poll_once()
        assert old.require_batcher().settings.max_queue_rows == 8 * own_rows  # while it loads
        keep, looks = repository.rolling.keep, []

        def keep_once_failing(name: str) -> set[str]:
            looks.append(name)
            if len(looks) == 1:
                raise RuntimeError("the switch table changed while it was read")
            return keep(name)

        monkeypatch.setattr(repository.rolling, "keep", keep_once_failing)
        loads.set()
        await _until(lambda: list(state.models["m"]) == ["2"])  # the hand-over, done again
        assert runners.made[("m", "1")].closed
        assert old.batcher is not None and old.batcher.settings.max_queue_rows == own_rows
        text = state.metrics.render().decode()
        assert metric(text, "shardserve_background_errors_total", task="settle") == 1.0
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and errors[0].exc_info is not None
        assert errors[0].getMessage() == (
            "model 'm' version 2's settle (the end of its load) failed (RuntimeError: the "
            "switch table changed while it was read)"
        )


def test_an_incomplete_version_is_listed_once_its_files_stop_changing(tmp_path: Path) -> None:
    version(tmp_path, "m", 1)
    copying = tmp_path / "m" / "2"
    copying.mkdir()
    (tmp_path / "m" / "3").mkdir()  # empty: nothing put there yet, never listed
    (copying / "m.keras").write_bytes(b"PK\x03\x04 first bytes")
    now = [0.0]
    settings = Settings(model_repository=tmp_path, repository_poll_s=5.0)
    source = Directory(tmp_path, settings, clock=lambda: now[0])

    def listed() -> dict[int, str | None]:
        return {v: p.error for v, p in source.scan()["m"].versions.items()}

    assert listed() == {1: None}  # a copy may be under way
    now[0] = 6.0
    (copying / "m.keras").write_bytes(b"PK\x03\x04 first bytes, then more")  # it is
    assert listed() == {1: None}
    now[0] = 15.0  # unchanged for 9 s: under two polls
    assert listed() == {1: None}
    now[0] = 16.0
    found = listed()
    assert sorted(found) == [1, 2] and found[1] is None
    assert found[2] is not None
    assert found[2].startswith(
        "its files are incomplete and have stopped changing: m.keras is not a complete zip yet"
    ), found[2]
    with zipfile.ZipFile(copying / "m.keras", "w") as archive:  # replaced whole: served
        archive.writestr("config.json", "{}")
    assert listed() == {1: None, 2: None}


async def _until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
