"""The server's state finds a served version by model name, version or label: the default model
(/predict's), a model's highest READY version, and the 400/404s that name what exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.life import VersionState
from serving.version.readiness import readiness
from serving.version.served import ServedModel
from tests.fakes import FakeRunner, put_in_state
from tests.serving.served_app import row
from tests.serving.served_repository import Runners, serve_repository, write_repository


async def _ready(state: ServerState, name: str, version: str) -> ServedModel:
    """A served version, loaded and warm over a fake runner."""
    model = ServedModel(name, state.settings, state.metrics, version=version)
    state.add_model(model)

    async def factory(_: Settings) -> FakeRunner:
        return FakeRunner()

    await model.load(factory, None)
    assert model.state is VersionState.READY, model.reason
    return model


def _loading(state: ServerState, name: str, version: str) -> ServedModel:
    model = ServedModel(name, state.settings, state.metrics, version=version)
    state.add_model(model)
    return model


def _state(**settings: object) -> ServerState:
    return ServerState(Settings(model="fake", batch_timeout_ms=0.0, **settings))  # type: ignore[arg-type]


async def test_the_default_model_is_the_only_one_or_the_named_one_else_a_400_listing_them() -> None:
    state = _state()
    with pytest.raises(NotReadyError, match="no model is served yet"):
        state.model()
    only = await _ready(state, "fake", "1")
    assert state.model() is only
    await _ready(state, "other", "1")
    with pytest.raises(InvalidInputError) as refused:
        state.model()
    assert refused.value.message == (
        "this server serves several models ('fake', 'other') and none is the default; name one "
        "in the path (/v1/models/{name}:predict, /v2/models/{name}/infer) or start the server "
        "with --default-model NAME"
    )
    state.default_model = "other"
    assert state.model().name == "other"


async def test_a_default_model_that_is_not_served_is_a_404_saying_why() -> None:
    state = _state()
    await _ready(state, "b", "1")
    state.default_model = "a"
    with pytest.raises(NotFoundError) as missing:
        state.model()
    assert missing.value.message == "the default model 'a' not found; this server serves 'b'"
    state.unserved["a"] = "unloaded through the repository API"
    with pytest.raises(NotFoundError) as unloaded:
        state.model()
    assert unloaded.value.message == (
        "the default model 'a' is not served (unloaded through the repository API); "
        "this server serves 'b'; load it with POST /v2/repository/models/a/load (with the "
        "admin token)"
    )
    with pytest.raises(NotFoundError, match=r"^model 'a' is not served \(unloaded"):
        state.model("a")


async def test_no_version_means_the_highest_ready_one_else_the_highest() -> None:
    state = _state()
    v2 = await _ready(state, "m", "2")
    v10 = _loading(state, "m", "10")  # "10" sorts after "9" and "2": versions are numbers
    assert state.model("m") is v2  # v10 still loads: requests go to what is ready
    assert state.model("m", "10") is v10
    v2.stop_accepting("being unloaded")
    assert state.model("m") is v10  # nothing ready: the highest says why (503 still loading)
    with pytest.raises(NotFoundError) as missing:
        state.model("m", "3")
    assert missing.value.message == "model 'm' has no version '3'; its versions: ['2', '10']"
    assert [m.version for m in state.served()] == ["2", "10"]


async def test_labels_name_a_version_and_go_with_it_when_it_is_removed() -> None:
    state = _state()
    v1 = await _ready(state, "m", "1")
    await _ready(state, "m", "2")
    state.labels["m"] = {"stable": "1", "canary": "2"}
    assert state.model("m", label="stable") is v1
    with pytest.raises(NotFoundError) as missing:
        state.model("m", label="beta")
    assert (
        missing.value.message == "model 'm' has no label 'beta'; its labels: ['canary', 'stable']"
    )
    with pytest.raises(
        InvalidInputError, match=r"name a version \('1'\) or a label \('stable'\) of"
    ):
        state.model("m", "1", "stable")
    assert state.remove_model("m", "2") is not None
    assert state.labels == {"m": {"stable": "1"}}
    assert state.remove_model("m", "1") is v1
    assert (state.models, state.labels) == ({}, {})
    assert state.remove_model("m", "1") is None


async def test_ready_once_nothing_loads_and_one_version_is_ready() -> None:
    state = _state()
    assert readiness(state).body() == {
        "status": "unavailable",
        "error": "no model version is served",
    }
    failed = _loading(state, "broken", "1")
    put_in_state(failed, "FAILED", reason="cannot read SavedModel broken")
    assert readiness(state).body() == {
        "status": "failed",
        "error": "cannot read SavedModel broken",
    }  # one version, failed: a 503 with its reason, as a one-model server always said
    await _ready(state, "good", "1")
    assert readiness(state).body() == {"status": "ready", "model": "good"}
    loading = _loading(state, "good", "2")
    loading._load_waits = "waiting for 1 placement group"
    assert readiness(state).body() == {
        "status": "loading",
        "error": "waiting for 1 placement group",
    }
    assert state.not_ready_reason() == "model is still loading"
    state.remove_model("good", "2")
    state.begin_stop()
    assert readiness(state).body() == {"status": "shutting down"}


async def test_once_every_model_is_unloaded_predict_and_admin_answer_404_saying_how_to_load(
    tmp_path: Path,
) -> None:
    write_repository(tmp_path, {"m": ([1], "")})
    auth = {"Authorization": "Bearer t0ken"}
    async with serve_repository(tmp_path, Runners(), admin_token="t0ken") as client:
        unloaded = await client.post("/v2/repository/models/m/unload", headers=auth)
        assert unloaded.status_code == 200, unloaded.text
        predict = await client.post("/predict", json={"instances": [row(1)]})
        admin = await client.get("/admin/batching", headers=auth)
        named = await client.post("/v1/models/m:predict", json={"instances": [row(1)]})
        loaded = await client.post("/v2/repository/models/m/load", headers=auth)
        assert loaded.status_code == 200, loaded.text
        again = await client.post("/predict", json={"instances": [row(1)]})
    how = "load it with POST /v2/repository/models/m/load (with the admin token)"
    # Not 503 "retry when GET /readyz answers 200": no retry brings it back.
    for answer in (predict, admin):
        assert (answer.status_code, answer.json()["error"]) == (
            404,
            f"no model is served: model 'm' was unloaded through the repository API; {how}",
        )
    assert (named.status_code, named.json()["error"]) == (
        404,
        f"model 'm' is not served (unloaded through the repository API); none is served; {how}",
    )
    assert again.status_code == 200, again.text


def test_several_unloaded_models_are_each_named() -> None:
    state = _state()
    state.unserved = {"b": "unloaded through the repository API", "a": "unloaded through it"}
    with pytest.raises(NotFoundError) as missing:
        state.model()
    assert missing.value.message == (
        "no model is served: 'a' unloaded through it; 'b' unloaded through the repository API; "
        "load one with POST /v2/repository/models/{name}/load (with the admin token)"
    )
