"""The model repository extension over HTTP (``POST /v2/repository/...``), in process over a
repository of fake-run models: the index, load and unload with the admin token, and the 4xx of
bodies and parameters shardserve does not take."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.errors import InvalidInputError
from serving.protocols.v2.http_repository import parse_body
from tests.serving.served_app import row
from tests.serving.served_repository import Runners, serve_repository, write_repository

TOKEN = "repo-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"instances": [row(1)]}


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    return write_repository(tmp_path / "repo", {"a": ([1, 2], ""), "b": ([1], "")})


async def test_unload_and_load_through_the_api(repository: Path) -> None:
    runners = Runners()
    async with serve_repository(repository, runners, admin_token=TOKEN) as client:
        index = await client.post("/v2/repository/index")
        meta = (await client.get("/v2")).json()
        unloaded = await client.post(
            "/v2/repository/models/b/unload",
            json={"parameters": {"unload_dependents": False}},  # as tritonclient sends it
            headers=AUTH,
        )
        gone = await client.post("/v1/models/b:predict", json=BODY)
        after_unload = (await client.post("/v2/repository/index", json={})).json()
        ready_only = (await client.post("/v2/repository/index", json={"ready": True})).json()
        loaded = await client.post("/v2/repository/models/b/load", json={}, headers=AUTH)
        back = await client.post("/v1/models/b:predict", json=BODY)
    assert "model_repository" in meta["extensions"]
    assert index.status_code == 200
    # policy "latest" (n = 1): a's version 1 is on disk, not served.
    assert [(e["name"], e.get("version"), e["state"]) for e in index.json()] == [
        ("a", "1", "UNAVAILABLE"),
        ("a", "2", "READY"),
        ("b", "1", "READY"),
    ]
    assert all(e["reason"] == "" for e in index.json() if e["state"] == "READY")
    assert (unloaded.status_code, unloaded.json()) == (200, {})
    assert runners.made[("b", "1")].closed
    assert gone.status_code == 404 and "'b'" in gone.json()["error"]
    b_entries = [e for e in after_unload if e["name"] == "b"]
    assert [e["state"] for e in b_entries] == ["UNAVAILABLE"] and b_entries[0]["reason"]
    assert [(e["name"], e["version"]) for e in ready_only] == [("a", "2")]
    assert (loaded.status_code, back.status_code) == (200, 200)


async def test_the_index_lists_a_version_that_will_not_complete_with_why(
    repository: Path,
) -> None:
    broken = repository / "b" / "2"
    broken.mkdir()
    (broken / "b.keras").write_bytes(b"not a zip: a copy cut short")
    async with serve_repository(repository, Runners(), admin_token=TOKEN) as client:
        first = (await client.post("/v2/repository/index")).json()
        # The next read of the repository (no polling: a load) finds it unchanged.
        loaded = await client.post("/v2/repository/models/b/load", headers=AUTH)
        index = (await client.post("/v2/repository/index")).json()
        served = await client.post("/v1/models/b:predict", json=BODY)
    assert ("b", "2") not in {(e["name"], e["version"]) for e in first}  # a copy under way?
    assert loaded.status_code == 200, loaded.text
    b_entries = {e["version"]: (e["state"], e["reason"]) for e in index if e["name"] == "b"}
    assert b_entries["1"] == ("READY", "")  # the complete version serves
    state, reason = b_entries["2"]
    assert state == "UNAVAILABLE"
    assert "b.keras is not a complete zip yet" in reason and str(repository) not in reason
    assert served.status_code == 200


async def test_load_and_unload_want_the_admin_token(repository: Path) -> None:
    async with serve_repository(repository, Runners(), admin_token=TOKEN) as client:
        bare = await client.post("/v2/repository/models/b/unload")
        wrong = await client.post(
            "/v2/repository/models/b/unload", headers={"Authorization": "Bearer nope"}
        )
        served = await client.post("/v1/models/b:predict", json=BODY)
    assert (bare.status_code, wrong.status_code, served.status_code) == (401, 403, 200)
    assert "Authorization: Bearer" in bare.json()["error"]
    async with serve_repository(repository, Runners()) as client:
        off = await client.post("/v2/repository/models/b/load")
        index = await client.post("/v2/repository/index")  # needs no token
        doc = (await client.get("/openapi.json")).json()
    assert off.status_code == 404 and "--admin-token" in off.json()["error"]
    assert index.status_code == 200
    assert "/v2/repository/index" in doc["paths"]
    assert "/v2/repository/models/{name}/load" not in doc["paths"]  # off: not listed


async def test_bodies_and_parameters_it_does_not_take_are_400s(repository: Path) -> None:
    async with serve_repository(repository, Runners(), admin_token=TOKEN) as client:
        answers = [
            await client.post("/v2/repository/index", json={"ready": "yes"}),
            await client.post("/v2/repository/index", content=b"[1]"),
            await client.post("/v2/repository/index", json={"repository": "x"}),
            await client.post(
                "/v2/repository/models/a/load",
                json={"parameters": {"config": "{}"}},
                headers=AUTH,
            ),
            await client.post(
                "/v2/repository/models/a/unload",
                json={"parameters": {"unload_dependents": "yes"}},
                headers=AUTH,
            ),
        ]
        unknown = await client.post("/v2/repository/models/zz/load", headers=AUTH)
        served = await client.post("/v1/models/a:predict", json=BODY)
    assert [r.status_code for r in answers] == [400] * 5
    errors = [r.json()["error"] for r in answers]
    assert errors[0] == "field 'ready' must be a boolean, got 'yes'"
    assert "must be a JSON object" in errors[1]
    assert errors[2] == "unknown field 'repository'; expected some of ['ready']"
    assert errors[3].startswith("load parameter 'config' is not taken (it takes none)")
    assert errors[4] == "unload parameter 'unload_dependents' must be a boolean, got 'yes'"
    assert unknown.status_code == 404 and "'zz'" in unknown.json()["error"]
    assert served.status_code == 200  # nothing above unloaded a


def test_an_empty_body_is_an_empty_request() -> None:
    assert parse_body(b"", {"ready": (bool,)}) == {} == parse_body(b" \n", {})
    assert parse_body(b'{"ready": false}', {"ready": (bool,)}) == {"ready": False}
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        parse_body(b"{", {})
    with pytest.raises(InvalidInputError, match="must be a boolean"):
        parse_body(b'{"ready": 1}', {"ready": (bool,)})
