"""Canaries in a served repository, in process over fake runners that tag every answer with their
version: a new READY version takes the canary's share beside the stable one (labels follow);
a canary the model raises on is rolled back (0 at once, kept loaded, the index says why, the
metric counts it) and a newer version replaces it; auto promotion retires the old stable; a
promote through the admin API under concurrent clients drops nothing; the API's refusals."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from serving.server.state import ServerState
from serving.settings.config import Settings
from tests.fakes import WAIT_S
from tests.serving.repository.test_manager import _until
from tests.serving.repository.test_repository_switch import PREDICT, Load, TaggedRunner, add_version
from tests.serving.served_app import row
from tests.serving.served_repository import serve_repository


@pytest.fixture(autouse=True)
def seeded_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary's draws seeded: each test's requests meet the same sides on every run."""
    monkeypatch.setattr("serving.canary.split._system_random", lambda: random.Random(11))


TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROLLOUT = "/admin/models/m/rollout"
TRAFFIC = "[traffic]\nstable = 50\ncanary = 50\n[canary]\nmin_requests = 10\n"


@dataclass
class Versions:
    """A ``TaggedRunner`` per version of ``m``; a poisoned one raises on a row whose first
    value is negative (the warm-up's zeros pass): the model raising on the input, a 422."""

    poisoned: set[int] = field(default_factory=set)
    made: dict[int, TaggedRunner] = field(default_factory=dict)
    held: dict[str, asyncio.Event] = field(default_factory=dict)  # model name -> its load waits

    async def __call__(self, settings: Settings) -> TaggedRunner:
        path = Path(str(settings.model))
        if path.parent.parent.name in self.held:
            await self.held[path.parent.parent.name].wait()
        v = int(path.parent.name)
        self.made[v] = TaggedRunner(v, poison=v in self.poisoned)
        return self.made[v]


def index(state: ServerState) -> dict[str, tuple[str, str]]:
    assert state.repository is not None
    return {
        f"{e['name']}/{e['version']}": (e["state"], e["reason"]) for e in state.repository.index()
    }


async def tags(client: httpx.AsyncClient, n: int, first: float = 1.0) -> list[object]:
    """``n`` requests in turn that name no version: the version that answered each (or the
    status when not 200)."""
    out: list[object] = []
    for _ in range(n):
        r = await client.post(PREDICT, json={"instances": [[first, 1.0, 2.0, 3.0]]})
        out.append(r.json()["predictions"][0][0] if r.status_code == 200 else r.status_code)
    return out


async def canary_of(client: httpx.AsyncClient, root: Path, v: int, config: str = "") -> None:
    state: ServerState = client.shardserve  # type: ignore[attr-defined]
    assert state.repository is not None
    add_version(root, v, config)
    await state.repository.poll_once()
    await _until(lambda: state.repository.rollouts["m"].canary == str(v))


async def test_a_canary_the_model_raises_on_is_rolled_back_kept_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_version(tmp_path, 1, TRAFFIC + "[labels]\ncanary = 1\n")
    versions = Versions(poisoned={2})
    async with serve_repository(tmp_path, versions, admin_token=TOKEN) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository.rollouts["m"].stable == "1" and state.labels["m"] == {"stable": "1"}
        await canary_of(client, tmp_path, 2)
        assert state.labels["m"] == {"stable": "1", "canary": "2"}  # the role wins
        first = await tags(client, 40)  # 50/50 drawn, no version named
        assert set(first) == {1.0, 2.0}
        assert index(state) == {"m/1": ("READY", ""), "m/2": ("READY", "")}

        rolled = state.repository.rollouts["m"]
        bad: list[object] = []
        with caplog.at_level(logging.WARNING, logger="shardserve"):
            while rolled.state == "canary" and len(bad) < 400:
                bad += await tags(client, 1, first=-1.0)  # version 2 raises on these
        assert (rolled.state, rolled.weights) == ("rolled_back", (50, 0))
        assert set(bad) == {1.0, 422} and bad[-1] == 422  # at once: that answer was its last
        assert await tags(client, 10, first=-1.0) == [1.0] * 10
        why = rolled.reason
        assert why is not None and why.startswith("rolled back: canary failure rate ")
        assert index(state) == {"m/1": ("READY", ""), "m/2": ("READY", why)}
        assert state.labels["m"] == {"stable": "1", "canary": "2"}
        assert any("version 2 rolled back (errors)" in r.message for r in caplog.records)
        metrics = (await client.get("/metrics")).text
        assert 'shardserve_rollbacks_total{model="m",reason="errors",version="2"} 1.0' in metrics
        kept = await client.post("/v1/models/m/versions/2:predict", json={"instances": [row(1)]})
        assert (kept.status_code, kept.json()["predictions"][0][0]) == (200, 2.0)
        view = (await client.get(ROLLOUT, headers=AUTH)).json()
        assert view["state"] == "rolled_back" and view["reason"] == why
        # Not the named one: only what the split sent it.
        assert view["versions"]["2"]["requests"] == first.count(2.0) + bad.count(422)

        await canary_of(client, tmp_path, 3)  # a newer version replaces the rolled-back one
        await _until(lambda: versions.made[2].closed)
        assert (state.repository.rollouts["m"].state, state.repository.rollouts["m"].weights) == (
            "canary",
            (50, 50),
        )
        assert index(state)["m/2"][0] == "UNAVAILABLE"
        assert set(await tags(client, 40)) == {1.0, 3.0}


async def flood(client: httpx.AsyncClient, version: str, n: int) -> list[int]:
    """``n`` requests of each kind a client can send one version with a deadline it cut short
    (1 us): TF Serving JSON by version and by label, V2 by version; each is a 504."""
    label = "stable" if version == "1" else "canary"
    short = {"X-Request-Timeout-Ms": "0.001"}
    v2 = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(1)}]}
    codes = []
    for _ in range(n):
        for path, body, headers in (
            (f"/v1/models/m/versions/{version}:predict", {"instances": [row(1)]}, short),
            (f"/v1/models/m/labels/{label}:predict", {"instances": [row(1)]}, short),
            (f"/v2/models/m/versions/{version}/infer", {**v2, "parameters": {"timeout": 1}}, {}),
        ):
            codes.append((await client.post(path, json=body, headers=headers)).status_code)
    return codes


async def test_a_flood_of_short_deadlines_at_the_canary_does_not_roll_it_back(
    tmp_path: Path,
) -> None:
    add_version(tmp_path, 1, TRAFFIC)
    async with serve_repository(tmp_path, Versions()) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        await canary_of(client, tmp_path, 2)
        codes = await flood(client, "2", 20)
        # Unversioned, so split between both: not counted against either, nor for it.
        short = {"X-Request-Timeout-Ms": "0.001"}
        for _ in range(20):
            r = await client.post(PREDICT, json={"instances": [row(1)]}, headers=short)
            codes.append(r.status_code)
        negative = await client.post(
            "/v2/models/m/versions/2/infer",
            json={
                "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(1)}],
                "parameters": {"timeout": -1},
            },
        )
        rollout = state.repository.rollouts["m"]
        counted = {v: w.count(rollout.now()) for v, w in rollout.windows.items()}
        assert set(await tags(client, 40)) == {1.0, 2.0}  # the split, still 50/50
    assert codes == [504] * 80
    assert negative.status_code == 400
    assert "must be a positive number of microseconds, got -1" in negative.json()["error"]
    assert (rollout.state, rollout.canary, rollout.weights) == ("canary", "2", (50, 50))
    assert counted == {"1": 0, "2": 0}


async def test_a_flood_at_the_stable_does_not_save_a_canary_failing_a_fifth_of_its_share(
    tmp_path: Path,
) -> None:
    # Judged on its failures alone: a p99 over a loaded machine's scheduling noise is not this test's.
    add_version(tmp_path, 1, TRAFFIC + "promote = 'auto'\nlatency_factor = 1000.0\n")
    async with serve_repository(tmp_path, Versions(poisoned={2})) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        await canary_of(client, tmp_path, 2)
        codes = await flood(client, "1", 20)  # 60 failures of the stable, were they counted
        answered: list[object] = []
        rollout = state.repository.rollouts["m"]
        # Every 5th request has a row version 2 raises on: the split draws which version gets
        # it, so the canary fails about a fifth of its share, the stable none of its.
        while rollout.state == "canary" and len(answered) < 1000:
            answered += await tags(client, 1, first=-1.0 if len(answered) % 5 == 4 else 1.0)
    assert codes == [504] * 60
    assert set(answered) == {1.0, 2.0, 422}
    assert (rollout.stable, rollout.state, rollout.weights) == ("1", "rolled_back", (50, 0))
    assert rollout.reason is not None
    assert rollout.reason.startswith("rolled back: canary failure rate 0.")
    assert " > stable 0.00 + 0.02 over " in rollout.reason


async def test_an_auto_canary_that_holds_its_window_becomes_stable_and_the_old_retires(
    tmp_path: Path,
) -> None:
    rules = "promote = 'auto'\nwindow_s = 0.3\nmin_requests = 2\n"
    add_version(tmp_path, 1, "[traffic]\nstable = 50\ncanary = 50\n[canary]\n" + rules)
    versions = Versions()
    async with serve_repository(tmp_path, versions) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        await canary_of(client, tmp_path, 2)
        since = time.monotonic()
        while state.repository.rollouts["m"].stable != "2":  # judged after answers and every second
            assert time.monotonic() - since < WAIT_S, state.repository.rollouts["m"].state
            await tags(client, 4)
        await _until(lambda: list(state.models["m"]) == ["2"])
        assert versions.made[1].closed
        assert state.labels["m"] == {"stable": "2"}
        assert await tags(client, 3) == [2.0] * 3


async def test_a_promote_through_the_api_under_load_drops_nothing(tmp_path: Path) -> None:
    add_version(tmp_path, 1, TRAFFIC)
    versions = Versions()
    async with serve_repository(tmp_path, versions, admin_token=TOKEN) as client:  # type: ignore[arg-type]
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        await canary_of(client, tmp_path, 2)
        load = Load(client)
        clients = [asyncio.create_task(load.one_client()) for _ in range(4)]
        try:
            await load.more(20)
            promoted = await client.post(f"{ROLLOUT}/promote", headers=AUTH)
            switched = time.monotonic()
            await _until(lambda: list(state.models["m"]) == ["2"])
            await load.more(20)
        finally:
            load.stopping = True
            await asyncio.wait_for(asyncio.gather(*clients), WAIT_S)
        assert promoted.status_code == 200, promoted.text
        body = promoted.json()
        assert (body["stable"], body["canary"], body["state"]) == ("2", None, "stable")
        assert body["weights"] == {"stable": 100, "canary": 0}
        assert [code for _, code, _ in load.answers if code != 200] == []  # none dropped
        assert set(load.tags()) == {1.0, 2.0}
        assert set(load.tags(switched)) == {2.0}
        assert versions.made[1].closed
        assert state.labels["m"] == {"stable": "2"}


async def test_the_rollout_api_wants_the_token_and_refuses_clearly(tmp_path: Path) -> None:
    add_version(tmp_path, 1, TRAFFIC)
    (tmp_path / "plain" / "1").mkdir(parents=True)
    (tmp_path / "plain" / "1" / "plain.keras").write_bytes((tmp_path / "m/1/m.keras").read_bytes())
    versions = Versions()
    async with serve_repository(tmp_path, versions, admin_token=TOKEN) as client:  # type: ignore[arg-type]

        async def call(method: str, path: str, **kw: object) -> tuple[int, str]:
            r = await client.request(method, path, headers=kw.pop("headers", AUTH), **kw)  # type: ignore[arg-type]
            return r.status_code, r.json().get("error", "")

        assert (await call("GET", ROLLOUT, headers={}))[0] == 401
        assert (await call("GET", ROLLOUT, headers={"Authorization": "Bearer no"}))[0] == 403
        assert await call("GET", "/admin/models/nope/rollout") == (
            404,
            "model 'nope' is not served; models with one: ['m']",
        )
        assert await call("POST", "/admin/models/plain/rollout/promote") == (
            404,
            "model 'plain' has no rollout: its config.toml has no [traffic] table; "
            "models with one: ['m']",
        )
        # A model with [traffic] whose only version still loads: no rollout yet, and it says so.
        late = tmp_path / "late"
        (late / "1").mkdir(parents=True)
        (late / "1" / "late.keras").write_bytes((tmp_path / "m/1/m.keras").read_bytes())
        (late / "config.toml").write_text(TRAFFIC)
        loading = versions.held["late"] = asyncio.Event()
        state: ServerState = client.shardserve  # type: ignore[attr-defined]
        assert state.repository is not None
        await state.repository.poll_once()
        assert await call("GET", "/admin/models/late/rollout") == (
            404,
            "model 'late' has no rollout yet: none of its versions is ready (a rollout begins "
            "with the first); models with one: ['m']",
        )
        loading.set()
        await _until(lambda: "late" in state.repository.rollouts)
        assert (await call("GET", "/admin/models/late/rollout"))[0] == 200
        await state.repository.unload("late")
        code, why = await call("POST", f"{ROLLOUT}/promote")
        assert (code, why) == (409, "model 'm' has no canary to promote; its stable version is 1")
        assert (await call("POST", f"{ROLLOUT}/rollback"))[0] == 409
        assert (await call("PUT", f"{ROLLOUT}/weights", json={"stable": 1, "canary": 1}))[0] == 409
        view = (await client.get(ROLLOUT, headers=AUTH)).json()
        assert view == {
            "model": "m",
            "stable": "1",
            "canary": None,
            "weights": {"stable": 100, "canary": 0},
            "state": "stable",
            "reason": None,
            "promote": "manual",
            "window_s": 60.0,
            "versions": {"1": {"requests": 0, "failure_rate": 0.0, "p99_ms": None}},
        }

        doc = (await client.get("/openapi.json")).json()
        rollout_paths = [path for path in doc["paths"] if "/rollout" in path]
        assert len(rollout_paths) == 4
        (name,) = doc["paths"][f"{ROLLOUT.replace('/m/', '/{name}/')}/weights"]["put"]["parameters"]
        assert name["schema"]["enum"] == ["m"]  # not 'plain': it could only answer 404
        await canary_of(client, tmp_path, 2, TRAFFIC)
        for body, want in (
            ({"stable": -1, "canary": 5}, "stable must be an integer weight from 0 to 1000000, "
             "got -1"),
            ({"stable": 0, "canary": 0}, "stable and canary are both 0"),
            ({"stable": 5}, "canary is missing: give both 'stable' and 'canary'"),
            ({"stable": 5, "canary": 5, "shadow": 1}, "unknown field 'shadow'"),
            ([1, 2], "body must be a JSON object"),
        ):  # fmt: skip
            code, why = await call("PUT", f"{ROLLOUT}/weights", json=body)
            assert code == 400 and want in why, (body, why)
        code, _ = await call("PUT", f"{ROLLOUT}/weights", json={"stable": 0, "canary": 3.0})
        assert code == 200
        assert await tags(client, 3) == [2.0] * 3
        code, _ = await call("POST", f"{ROLLOUT}/rollback")
        assert code == 200 and await tags(client, 2) == [1.0] * 2
        assert 'reason="manual"' in (await client.get("/metrics")).text
