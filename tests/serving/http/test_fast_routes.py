"""The fast path is one layer of the middleware stack: a user's middleware wraps it (and the
router), request ids reach every response, and an error escaping a fast handler is still mapped."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from fastapi import Request, Response
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.errors import NotReadyError
from serving.http.fast import FastRoutes, ModelRef
from serving.server.app import ShardServeApp, create_app
from serving.settings.config import Settings
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner, expected_outputs

ROW = [1.0, 2.0, 3.0, 4.0]
V2_BODY = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ROW}]}
ORIGIN = "https://app.example"


class Recorder:
    """A user's pure ASGI middleware: notes each request it sees and marks each response."""

    def __init__(self, app: ASGIApp, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.seen.append(f"{scope['method']} {scope['path']}")

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message["headers"], (b"x-user-middleware", b"1")]
            await send(message)

        await self.app(scope, receive, marked)


@contextlib.asynccontextmanager
async def serve_with(*middleware: tuple[Any, dict[str, Any]]) -> AsyncIterator[httpx.AsyncClient]:
    runner = FakeRunner()

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(Settings(model="fake", batch_timeout_ms=0, admin_token="tok"), factory)
    for cls, options in middleware:
        app.add_middleware(cls, **options)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.model().until_ready()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


def expected_y() -> list[float]:
    import numpy as np

    return expected_outputs({"x": np.array([ROW], np.float32)})["y"][0].tolist()


async def test_cors_headers_reach_predict_responses() -> None:
    cors = (
        CORSMiddleware,
        {"allow_origins": [ORIGIN], "allow_methods": ["POST"], "expose_headers": ["X-Request-Id"]},
    )
    async with serve_with(cors) as client:
        origin = {"Origin": ORIGIN}
        answers = [
            await client.post("/predict", json={"instances": [ROW]}, headers=origin),
            await client.post("/v1/models/fake:predict", json={"instances": [ROW]}, headers=origin),
            await client.post("/v2/models/fake/infer", json=V2_BODY, headers=origin),
            await client.post("/v1/models/nope:predict", json={"instances": [ROW]}, headers=origin),
        ]
        preflight = await client.options(
            "/predict",
            headers={**origin, "Access-Control-Request-Method": "POST"},
        )
    assert [r.status_code for r in answers] == [200, 200, 200, 404]
    assert answers[0].json() == {"predictions": [expected_y()]}
    assert answers[2].json()["outputs"][0]["data"] == pytest.approx(expected_y())
    for r in answers:
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-expose-headers"] == "X-Request-Id"
        assert len(r.headers["x-request-id"]) == 24
    # The preflight is CORS's own answer: it never reaches the app, and still has a request id.
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert preflight.headers["access-control-allow-methods"] == "POST"
    assert len(preflight.headers["x-request-id"]) == 24


async def test_a_user_middleware_wraps_fast_and_routed_requests() -> None:
    seen: list[str] = []
    async with serve_with((Recorder, {"seen": seen})) as client:
        fast = await client.post("/predict", json={"instances": [ROW]})
        v2 = await client.post("/v2/models/fake/versions/1/infer", json=V2_BODY)
        routed = [
            await client.get("/healthz"),
            await client.get("/v1/models/fake/metadata"),
            await client.get("/admin/batching", headers={"Authorization": "Bearer tok"}),
            await client.get("/no/such/route"),
        ]
    assert [fast.status_code, v2.status_code] == [200, 200]
    assert [r.status_code for r in routed] == [200, 200, 200, 404]
    assert seen == [
        "POST /predict",
        "POST /v2/models/fake/versions/1/infer",
        "GET /healthz",
        "GET /v1/models/fake/metadata",
        "GET /admin/batching",
        "GET /no/such/route",
    ]
    for r in [fast, v2, *routed]:
        assert r.headers["x-user-middleware"] == "1"
        assert len(r.headers["x-request-id"]) == 24


async def test_the_fast_path_sits_inside_user_middleware_and_outside_the_router() -> None:
    app = create_app(Settings(model="fake"), lambda _: FakeRunner())  # type: ignore[arg-type,return-value]
    app.add_middleware(Recorder, seen=[])
    stack = app.build_middleware_stack()
    names = []
    layer: Any = stack
    while layer is not app.router:
        names.append(type(layer).__name__)
        layer = layer.app
    assert names.index("ServerErrorMiddleware") < names.index("Recorder")
    assert names.index("Recorder") + 1 == names.index("FastPathLayer")
    assert names.index("FastPathLayer") < names.index("ExceptionMiddleware")
    assert app.user_middleware[-1].cls is Recorder  # the user's list is left as it was


async def test_request_ids_are_echoed_on_both_paths() -> None:
    async with serve_with() as client:
        rid = {"X-Request-Id": "trace-1"}
        fast = await client.post("/predict", json={"instances": [ROW]}, headers=rid)
        bad = await client.post("/predict", json={"instances": [[1, 2]]}, headers=rid)
        routed = await client.get("/v1/models/fake", headers=rid)
        refused = await client.delete("/predict", headers=rid)
    for r in (fast, bad, routed, refused):
        assert r.headers["x-request-id"] == "trace-1"
        assert r.headers.get_list("x-request-id") == ["trace-1"]  # once, not twice
    assert (fast.status_code, bad.status_code, routed.status_code) == (200, 400, 200)
    assert refused.status_code == 405


async def test_405_names_every_method_of_the_path() -> None:
    async with serve_with() as client:
        admin = await client.delete("/admin/batching", headers={"Authorization": "Bearer tok"})
        predict = await client.get("/predict")
        named = await client.get("/v1/models/fake:predict")
        status = await client.put("/v1/models/fake")
        infer = await client.get("/v2/models/fake/infer")
    assert [r.status_code for r in (admin, predict, named, status, infer)] == [405] * 5
    assert admin.headers["allow"] == "GET, PUT"
    assert predict.headers["allow"] == "POST"
    # GET /v1/models/{name} does not take "fake:predict" as a name: that path is POST only.
    assert named.headers["allow"] == "POST"
    assert status.headers["allow"] == "GET"
    assert infer.headers["allow"] == "POST"
    assert assert_clean_error(admin) == "Method Not Allowed"


async def test_an_error_escaping_a_fast_handler_is_mapped() -> None:
    async def loading(ref: ModelRef, request: Request) -> Response:
        raise NotReadyError(f"{ref.name} is warming up")

    async def broken(ref: ModelRef, request: Request) -> Response:
        raise RuntimeError("0xdeadbeef at pid=7")

    runner = FakeRunner()

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(Settings(model="fake"), factory)
    assert isinstance(app, ShardServeApp)
    app.fast_routes.add("/loading/{name}", loading)
    app.fast_routes.add("/broken", broken, name="fake")
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            warming = await client.post("/loading/m1")
            failed = await client.post("/broken", headers={"X-Request-Id": "b-1"})
    assert (warming.status_code, assert_clean_error(warming)) == (503, "m1 is warming up")
    assert failed.status_code == 500
    assert assert_clean_error(failed) == "internal server error; see the server log"
    assert failed.headers["x-request-id"] == "b-1"


def test_fast_routes_match_templates() -> None:
    async def handler(ref: ModelRef, request: Request) -> Response:
        return Response()

    routes = FastRoutes()
    routes.add("/predict", handler)
    routes.add("/served", handler, name="served")
    routes.add("/v1/models/{name}:predict", handler)
    routes.add("/v1/models/{name}/versions/{version}:predict", handler)
    routes.add("/v1/models/{name}/labels/{label}:predict", handler)
    routes.add("/v2/models/{name}/versions/{version}/infer", handler)

    def match(path: str) -> ModelRef | None:
        hit = routes.match(path)
        return None if hit is None else hit[1]

    assert match("/predict") == ModelRef(None)  # the default model, found per request
    assert match("/served") == ModelRef("served")
    assert match("/v1/models/m-1.a:predict") == ModelRef("m-1.a")
    assert match("/v1/models/m/versions/3:predict") == ModelRef("m", "3")
    assert match("/v1/models/m/labels/stable:predict") == ModelRef("m", label="stable")
    assert match("/v2/models/m/versions/7/infer") == ModelRef("m", "7")
    assert match("/v1/models/a/b:predict") is None  # a name is one path segment
    assert match("/v1/models/:predict") is None
    assert match("/v1/models/m/labels/:predict") is None
    assert match("/predict/") is None
    assert match("/v2/models/m/infer") is None
    assert match("/v1/models/m:predictx") is None
    assert match("/v1/models/m/versions/3:predict") is match("/v1/models/m/versions/3:predict")
    with pytest.raises(ValueError, match="names both a version and a label"):
        routes.add("/m/{name}/{version}/{label}", handler)
