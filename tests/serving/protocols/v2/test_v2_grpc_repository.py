"""The model repository extension and ``model_version`` over gRPC, through Triton's own client
(``tritonclient.grpc.aio``): an in-process grpc.aio server over the server's state and a fake
repository control (the manager is tested on its own), no app and no Ray."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from asgi_lifespan import LifespanManager
from tritonclient.grpc import InferInput, service_pb2
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from serving.errors import NotFoundError
from serving.metrics.series import Metrics
from serving.protocols.contract import IndexEntry, RepositoryControl
from serving.protocols.grpc_port import start_grpc_server, stop_grpc_server
from serving.server.app import create_app
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.version.served import ServedModel
from tests.errorcheck import assert_clean_error
from tests.fakes import WAIT_S, FakeRunner, expected_outputs, make_rows
from tests.serverproc import free_ports

TOKEN = "s3cret-token"
BEARER = {"authorization": f"Bearer {TOKEN}"}


class FakeRepository:
    """A repository of ``a`` (versions 1 READY, 2 LOADING) and ``b`` (1 UNAVAILABLE); load and
    unload are recorded, and ``hold`` keeps a load waiting."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.finished: list[tuple[str, str]] = []
        self.hold: asyncio.Event | None = None
        self.fail_with: BaseException | None = None
        self.entries: list[IndexEntry] = [
            {"name": "a", "version": "1", "state": "READY", "reason": ""},
            {"name": "a", "version": "2", "state": "LOADING", "reason": "loading"},
            {"name": "b", "version": "1", "state": "UNAVAILABLE", "reason": "no such layer 'x'"},
        ]

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        return [e for e in self.entries if not ready_only or e["state"] == "READY"]

    async def load(self, name: str) -> None:
        await self._call("load", name)

    async def unload(self, name: str) -> None:
        await self._call("unload", name)

    async def _call(self, what: str, name: str) -> None:
        self.calls.append((what, name))
        if self.fail_with is not None:
            raise self.fail_with
        if name not in {"a", "b"}:
            raise NotFoundError(f"model {name!r} is not in the repository; it holds 'a', 'b'")
        if self.hold is not None:
            await self.hold.wait()
        self.finished.append((what, name))


@contextlib.asynccontextmanager
async def serve(
    state: ServerState | None = None,
    control: RepositoryControl | None = None,
    admin_token: str | None = TOKEN,
) -> AsyncIterator[InferenceServerClient]:
    (port,) = free_ports(1)
    settings = Settings(model="fake", host="127.0.0.1", grpc_port=port, admin_token=admin_token)
    directory = state if state is not None else ServerState(settings)
    server = await start_grpc_server(directory, settings, lambda: control)
    try:
        async with InferenceServerClient(f"127.0.0.1:{port}") as client:
            yield client
    finally:
        await stop_grpc_server(server, grace_s=0)


async def refused(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    """The status and clean one-line message of a call that must fail (through tritonclient's
    methods or straight through its stub)."""
    with pytest.raises((InferenceServerException, grpc.aio.AioRpcError)) as info:
        await call
    error = info.value
    if isinstance(error, grpc.aio.AioRpcError):
        code, message = error.code(), error.details() or ""
    else:
        code = getattr(grpc.StatusCode, error.status().removeprefix("StatusCode."))
        message = error.message()
    assert_clean_error({"error": message})
    assert "\n" not in message and "Traceback" not in message
    return code, message


# ---- RepositoryIndex ----------------------------------------------------------------------------


async def test_index_lists_every_version_with_its_state_and_reason_without_a_token() -> None:
    async with serve(control=FakeRepository()) as client:
        index = await client.get_model_repository_index(as_json=True)
        # Triton's request with ready set, through Triton's own stub.
        ready = await client._client_stub.RepositoryIndex(
            service_pb2.RepositoryIndexRequest(ready=True)
        )
        code, message = await refused(
            client._client_stub.RepositoryIndex(
                service_pb2.RepositoryIndexRequest(repository_name="models")
            )
        )
    # json_format leaves out empty strings (a READY version's reason).
    assert index["models"] == [
        {"name": "a", "version": "1", "state": "READY"},
        {"name": "a", "version": "2", "state": "LOADING", "reason": "loading"},
        {"name": "b", "version": "1", "state": "UNAVAILABLE", "reason": "no such layer 'x'"},
    ]
    assert [(m.name, m.version, m.state, m.reason) for m in ready.models] == [
        ("a", "1", "READY", "")
    ]
    assert code == grpc.StatusCode.NOT_FOUND
    assert message == (
        "repository 'models' not found; this server has one model repository: "
        "leave repository_name empty"
    )


async def test_no_repository_yet_is_unavailable() -> None:
    async with serve(control=None) as client:
        code, message = await refused(client.get_model_repository_index())
        load_code, _ = await refused(client.load_model("a", headers=BEARER))
    assert code == load_code == grpc.StatusCode.UNAVAILABLE
    assert "model repository is not running" in message


# ---- RepositoryModelLoad / RepositoryModelUnload -----------------------------------------------


async def test_load_and_unload_with_the_admin_token() -> None:
    control = FakeRepository()
    async with serve(control=control) as client:
        await client.load_model("a", headers=BEARER)
        # tritonclient always sends unload_dependents; nothing depends on a model here.
        await client.unload_model("b", headers=BEARER, unload_dependents=True)
        code, message = await refused(client.load_model("c", headers=BEARER))
    assert control.finished == [("load", "a"), ("unload", "b")]
    assert code == grpc.StatusCode.NOT_FOUND
    assert message == "model 'c' is not in the repository; it holds 'a', 'b'"


NO_BEARER = "repository load and unload need the header 'Authorization: Bearer <admin token>'"


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED, NO_BEARER),
        ({"authorization": TOKEN}, grpc.StatusCode.UNAUTHENTICATED, NO_BEARER),  # no scheme
        (
            {"authorization": "Bearer wrong"},
            grpc.StatusCode.PERMISSION_DENIED,
            "the bearer token does not match the server's admin token",
        ),
    ],
)
async def test_load_and_unload_without_the_right_token_are_refused(
    headers: dict[str, str] | None, status: grpc.StatusCode, message: str
) -> None:
    control = FakeRepository()
    async with serve(control=control) as client:
        load = await refused(client.load_model("a", headers=headers))
        unload = await refused(client.unload_model("a", headers=headers))
    assert load == unload == (status, message)
    assert control.calls == []


async def test_without_an_admin_token_load_is_off_and_the_index_answers() -> None:
    control = FakeRepository()
    async with serve(control=control, admin_token=None) as client:
        refusal = await refused(client.load_model("a", headers=BEARER))
        assert (await client.get_model_repository_index(as_json=True))["models"]
    assert refusal == (
        grpc.StatusCode.NOT_FOUND,
        "repository load and unload are off; start the server with --admin-token to use them",
    )
    assert control.calls == []


async def test_load_parameters_are_refused_by_name_and_a_bad_name_is_invalid() -> None:
    control = FakeRepository()
    async with serve(control=control) as client:
        config = await refused(client.load_model("a", headers=BEARER, config='{"x": 1}'))
        files = await refused(client.load_model("a", headers=BEARER, files={"file:1/m": b"x"}))
        empty = await refused(client.load_model("", headers=BEARER))
        request = service_pb2.RepositoryModelUnloadRequest(model_name="a")
        request.parameters["unload_dependents"].string_param = "yes"
        dependents = await refused(
            client._client_stub.RepositoryModelUnload(request, metadata=tuple(BEARER.items()))
        )
    assert config[0] == files[0] == empty[0] == dependents[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert config[1].startswith("RepositoryModelLoad parameter 'config' is not supported")
    assert "<model>/config.toml" in config[1]
    assert files[1].startswith("RepositoryModelLoad parameter 'file:1/m' is not supported")
    assert empty[1].startswith("RepositoryModelLoad: model_name is empty")
    assert dependents[1] == (
        "RepositoryModelUnload parameter 'unload_dependents' must be a bool_param"
    )
    assert control.calls == []


async def test_an_unexpected_failure_is_internal_without_its_details() -> None:
    control = FakeRepository()
    control.fail_with = RuntimeError("boom at /srv/models/a/1 pid 4242")
    async with serve(control=control) as client:
        code, message = await refused(client.unload_model("a", headers=BEARER))
    assert (code, message) == (
        grpc.StatusCode.INTERNAL,
        "internal server error; see the server log",
    )


async def test_a_load_outlives_a_client_that_gives_up() -> None:
    control = FakeRepository()
    control.hold = asyncio.Event()
    async with serve(control=control) as client:
        code, _ = await refused(client.load_model("a", headers=BEARER, client_timeout=0.2))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert control.calls == [("load", "a")]
        control.hold.set()
        async with asyncio.timeout(WAIT_S):
            while control.finished != [("load", "a")]:
                await asyncio.sleep(0.01)


# ---- model_version in ModelInfer, ModelReady, ModelMetadata -------------------------------------


async def test_model_version_picks_the_version_and_a_missing_one_names_those_there_are() -> None:
    state = ServerState(Settings(model="fake", batch_timeout_ms=0.0))
    warm_up_2 = asyncio.Event()  # holds version 2's warm-up batch
    runners = {"1": FakeRunner(), "2": FakeRunner(gate=warm_up_2)}
    versions = {v: ServedModel("fake", state.settings, Metrics(), version=v) for v in runners}

    for version, model in versions.items():
        state.add_model(model)

        async def factory(_: Settings, runner: FakeRunner = runners[version]) -> FakeRunner:
            return runner

        model.start(factory, None)
    await asyncio.wait_for(versions["1"].until_ready(), WAIT_S)
    rows = make_rows(2)["x"]
    tensor = InferInput("x", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)

    try:
        async with serve(state) as client:
            # Version 2 is still warming up: named, it is not ready; unnamed, 1 answers.
            assert await client.is_model_ready("fake", "1") is True
            assert await client.is_model_ready("fake", "2") is False
            unnamed = await client.infer("fake", [tensor])
            assert unnamed.get_response().model_version == "1"
            warm_up_2.set()
            await asyncio.wait_for(versions["2"].until_ready(), WAIT_S)
            runners["1"].batches.clear()
            runners["2"].batches.clear()

            one = await client.infer("fake", [tensor], model_version="1")
            two = await client.infer("fake", [tensor], model_version="2")
            latest = await client.infer("fake", [tensor])
            meta = await client.get_model_metadata("fake", "2", as_json=True)
            missing = [
                await refused(client.infer("fake", [tensor], model_version="3")),
                await refused(client.is_model_ready("fake", "3")),
                await refused(client.get_model_metadata("fake", "3")),
            ]
    finally:
        budget = state.begin_stop()
        await asyncio.gather(*(m.stop_jobs(WAIT_S) for m in versions.values()))
        await state.drain(budget)

    assert [r.get_response().model_version for r in (one, two, latest)] == ["1", "2", "2"]
    # Each version's rows ran on its own runner: 1 once, 2 twice (named and unnamed).
    assert [len(runners[v].batches) for v in ("1", "2")] == [1, 2]
    np.testing.assert_array_equal(two.as_numpy("y"), expected_outputs({"x": rows})["y"])
    assert (meta["name"], meta["versions"]) == ("fake", ["1", "2"])  # every version served
    assert (
        missing
        == [
            (grpc.StatusCode.NOT_FOUND, "model 'fake' has no version '3'; its versions: ['1', '2']")
        ]
        * 3
    )


# ---- through the app: the lifespan's repository manager behind the calls ------------------------


async def test_unload_and_load_through_the_apps_repository(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "manifest.json").write_text("{}")  # a complete bundle
    (port,) = free_ports(1)
    settings = Settings(
        model_repository=tmp_path, grpc_port=port, admin_token=TOKEN, batch_timeout_ms=0.0
    )
    runners: list[FakeRunner] = []

    async def factory(version: Settings) -> FakeRunner:
        runners.append(FakeRunner())
        return runners[-1]

    rows = make_rows(1)["x"]
    tensor = InferInput("x", list(rows.shape), "FP32")
    tensor.set_data_from_numpy(rows)

    def index(answer: dict[str, Any]) -> list[tuple[str, str, str]]:
        return [(m["name"], m.get("version", ""), m["state"]) for m in answer["models"]]

    app = create_app(settings, factory)
    async with (
        LifespanManager(app),
        InferenceServerClient(f"127.0.0.1:{port}") as client,
    ):
        state: ServerState = app.state.shardserve
        async with asyncio.timeout(WAIT_S):
            while state.not_ready_reason() is not None:
                await asyncio.sleep(0.01)
        before = index(await client.get_model_repository_index(as_json=True))
        await client.unload_model("b", headers=BEARER)
        closed = [r.closed for r in runners]
        unloaded = index(await client.get_model_repository_index(as_json=True))
        gone = await refused(client.infer("b", [tensor]))
        await client.load_model("b", headers=BEARER)
        answer = await client.infer("b", [tensor], model_version="1")
    assert before == [("a", "1", "READY"), ("b", "1", "READY")]
    assert ("a", "1", "READY") in unloaded and ("b", "1", "READY") not in unloaded
    assert gone[0] == grpc.StatusCode.NOT_FOUND and "'b'" in gone[1]
    assert answer.get_response().model_version == "1"
    np.testing.assert_array_equal(answer.as_numpy("y"), expected_outputs({"x": rows})["y"])
    # The unload ended b's runner (its actors) and only b's; the load made a new one.
    assert sorted(closed) == [False, True] and len(runners) == 3
