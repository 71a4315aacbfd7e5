"""The OpenAPI document as a contract: a predict body its schema accepts is one the server
accepts, and the other way round (in-process, with the fake runner)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from asgi_lifespan import LifespanManager

from serving.openapi.tfserving import predict_schemas
from serving.server.app import create_app
from serving.settings.config import Settings
from shards.signature import ModelSignature, TensorSpec
from tests.fakes import FakeRunner
from tests.serving.served_repository import Runners, serve_repository, write_repository

TWO_INPUTS = ModelSignature(
    "two",
    (TensorSpec("a", (2,), "float32"), TensorSpec("ids", (3,), "int32")),
    (TensorSpec("y", (2,), "float32"), TensorSpec("z", (), "float32")),
)


@contextlib.asynccontextmanager
async def serve(
    runner: FakeRunner, *, wait_ready: bool = True, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        model="fake",
        **{"batch_timeout_ms": 0, "max_batch_size": 4, "max_queue_rows": 8, **overrides},
    )

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        if wait_ready:
            await app.state.shardserve.model().until_ready()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def predict_schema(client: httpx.AsyncClient) -> dict[str, Any]:
    doc = (await client.get("/openapi.json")).json()
    body = doc["paths"]["/predict"]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/PredictRequest"
    }
    schema: dict[str, Any] = doc["components"]["schemas"]["PredictRequest"]
    return schema


def schema_accepts(schema: dict[str, Any], body: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(body)


ROW = [1.0, 2.0, 3.0, 4.0]
ONE_INPUT_BODIES = [
    {"instances": [ROW]},
    {"instances": [ROW] * 8},
    {"instances": [{"x": ROW}, {"x": ROW}]},
    {"inputs": [ROW, ROW]},
    {"inputs": {"x": [ROW]}},
    {"instances": [ROW], "signature_name": "serving_default"},
    {"instances": [[1, 2, 3, 4]]},
    {"instances": [ROW] * 9},  # over max_queue_rows
    {"instances": []},
    {"instances": [[1.0, 2.0, 3.0]]},
    {"instances": [ROW, {"x": ROW}]},
    {"instances": [[1.0, 2.0, 3.0, "4"]]},
    {"instances": [[1.0, 2.0, 3.0, True]]},
    {"instances": [[1.0, 2.0, 3.0, None]]},
    {"instances": [ROW], "inputs": [ROW]},
    {"rows": [ROW]},
    {"inputs": {"y": [ROW]}},
    {"inputs": {"x": []}},
    [ROW],
    {},
]


@pytest.mark.parametrize("body", ONE_INPUT_BODIES)
async def test_the_schema_and_the_server_agree_on_a_body(body: Any) -> None:
    async with serve(FakeRunner()) as client:
        schema = await predict_schema(client)
        r = await client.post("/predict", json=body)
    assert r.status_code in (200, 400), r.text
    assert schema_accepts(schema, body) == (r.status_code == 200), r.text


TWO_INPUT_BODIES = [
    {"instances": [{"a": [1.0, 2.0], "ids": [1, 2, 3]}]},
    {"inputs": {"a": [[1.0, 2.0]], "ids": [[1, 2, 3]]}},
    {"instances": [{"a": [1.0, 2.0]}]},
    {"instances": [{"a": [1.0, 2.0], "ids": [1, 2, 3.5]}]},
    {"instances": [{"a": [1.0, 2.0], "ids": [1, 2, 2**31]}]},
    {"instances": [[1.0, 2.0]]},
    {"inputs": [[1.0, 2.0]]},
]


@pytest.mark.parametrize("body", TWO_INPUT_BODIES)
async def test_a_model_of_two_inputs_is_documented_as_served(body: Any) -> None:
    async with serve(FakeRunner(TWO_INPUTS)) as client:
        schema = await predict_schema(client)
        r = await client.post("/predict", json=body)
        doc = (await client.get("/openapi.json")).json()
    assert r.status_code in (200, 400), r.text
    assert schema_accepts(schema, body) == (r.status_code == 200), r.text
    if r.status_code == 200:
        answer = doc["components"]["schemas"]["PredictResponse"]
        assert schema_accepts(answer, r.json())


async def test_answers_fit_the_response_schema() -> None:
    async with serve(FakeRunner()) as client:
        doc = (await client.get("/openapi.json")).json()
        rows = await client.post("/predict", json={"instances": [ROW, ROW]})
        columns = await client.post("/v1/models/fake:predict", json={"inputs": [ROW]})
    answer = doc["components"]["schemas"]["PredictResponse"]
    assert rows.json() == {"predictions": [[10.0, 4.0], [10.0, 4.0]]}
    assert columns.json() == {"outputs": [[10.0, 4.0]]}
    assert schema_accepts(answer, rows.json()) and schema_accepts(answer, columns.json())
    assert not schema_accepts(answer, {"predictions": [[10.0]]})


async def test_the_document_before_and_after_the_model_loads() -> None:
    import asyncio

    release = asyncio.Event()
    runner = FakeRunner()

    async def slow_factory(_: Settings) -> FakeRunner:
        await release.wait()
        return runner

    app = create_app(Settings(model="fake", batch_timeout_ms=0), slow_factory)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            before = await predict_schema(client)
            release.set()
            await app.state.shardserve.model().until_ready()
            after = await predict_schema(client)
    body = {"instances": [[1.0, 2.0]]}  # the wrong width for the model
    assert schema_accepts(before, body) and not schema_accepts(after, body)
    assert "still loading" in before["description"]


async def test_statuses_headers_and_names_are_documented() -> None:
    async with serve(FakeRunner()) as client:
        doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    named = paths["/v1/models/{name}:predict"]["post"]
    assert sorted(named["responses"]) == ["200", "400", "404", "413", "422", "500", "503", "504"]
    (name,) = named["parameters"]
    assert name["schema"] == {"type": "string", "enum": ["fake"]}
    assert "Retry-After" in named["responses"]["503"]["headers"]
    assert named["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    for path, operations in paths.items():
        for operation in operations.values():
            for status, response in operation["responses"].items():
                header = response["headers"]["X-Request-Id"]
                assert header == {"$ref": "#/components/headers/X-Request-Id"}, (path, status)
    assert doc["components"]["headers"]["X-Request-Id"]["required"] is True
    # OpenMetrics when the scraper asks for it (its exemplars carry trace ids: issue 30)
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain",
        "application/openmetrics-text",
    ]
    assert sorted(paths["/readyz"]["get"]["responses"]) == ["200", "503"]
    assert "/admin/batching" not in paths  # off without an admin token
    assert not [path for path in paths if "{label}" in path]  # no label is set


async def test_admin_routes_are_documented_with_their_token() -> None:
    async with serve(FakeRunner(), admin_token="tok") as client:
        doc = (await client.get("/openapi.json")).json()
        r = await client.put(
            "/admin/batching",
            json={"max_batch_size": 3.0, "batch_timeout_ms": "auto"},
            headers={"Authorization": "Bearer tok"},
        )
    admin = doc["paths"]["/admin/batching"]
    assert admin["get"]["security"] == admin["put"]["security"] == [{"adminToken": []}]
    assert doc["components"]["securitySchemes"]["adminToken"]["scheme"] == "bearer"
    assert sorted(admin["put"]["responses"]) == ["200", "400", "401", "403", "413", "503"]
    change = admin["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema_accepts(change, {"max_batch_size": 3.0, "batch_timeout_ms": "auto"})
    assert not schema_accepts(change, {}) and not schema_accepts(change, {"max_queue_rows": 9})
    # JSON's 3.0 is the integer 3, as the schema says.
    assert (r.status_code, r.json()["max_batch_size"]) == (200, 3)


async def test_the_examples_are_answered() -> None:
    async with serve(FakeRunner(TWO_INPUTS)) as client:
        doc = (await client.get("/openapi.json")).json()
        paths = doc["paths"]
        predict = paths["/predict"]["post"]["requestBody"]["content"]["application/json"]
        infer = paths["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
        r1 = await client.post("/predict", json=predict["example"])
        r2 = await client.post("/v2/models/fake/infer", json=infer["application/json"]["example"])
    assert predict["example"] == {"instances": [{"a": [0, 0], "ids": [0, 0, 0]}]}
    assert r1.status_code == 200 and r2.status_code == 200
    assert [o["name"] for o in r2.json()["outputs"]] == ["y", "z"]


def v2(data: Any, shape: list[int] | None = None, **fields: Any) -> dict[str, Any]:
    tensor = {"name": "x", "shape": shape or [1, 4], "datatype": "FP32", "data": data}
    return {"inputs": [{**tensor, **fields.pop("tensor", {})}], **fields}


V2_BODIES = [
    v2([1, 2, 3, 4]),
    v2([[1.0, 2.0, 3.0, 4.0], ROW], shape=[2, 4]),
    v2(ROW * 4, shape=[4, 4], id="r-1", parameters={"binary_data_output": False}),
    v2(ROW, outputs=[{"name": "y", "parameters": {"binary_data": False}}]),
    v2(ROW * 2),  # 8 values for shape [1, 4]
    v2(ROW, shape=[2, 4]),
    v2([*ROW, 5.0], shape=[1, 5]),
    v2([1.0, 2.0, 3.0, True]),
    v2([1.0, 2.0, 3.0, "4"]),
    v2(ROW, tensor={"datatype": "FP64"}),
    v2(ROW, tensor={"name": "z"}),
    v2(ROW, tensor={"parameters": {"binary_data_size": 16}}),
    v2(ROW, outputs=[{"name": "nope"}]),
    v2(ROW, id=7),
    v2(ROW, outputs=None),
    v2(ROW, outputs={}),
    {"inputs": []},
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32"}]},
]


@pytest.mark.parametrize("body", V2_BODIES)
async def test_the_v2_infer_schema_and_the_server_agree_on_a_body(body: Any) -> None:
    async with serve(FakeRunner()) as client:
        doc = (await client.get("/openapi.json")).json()
        r = await client.post("/v2/models/fake/infer", json=body)
    infer = doc["paths"]["/v2/models/{name}/infer"]["post"]
    # The binary extension is described in words, not as a header or a body to draw from.
    assert list(infer["requestBody"]["content"]) == ["application/json"]
    assert all(p["in"] == "path" for p in infer["parameters"])
    schema = infer["requestBody"]["content"]["application/json"]["schema"]
    assert "Inference-Header-Content-Length" in schema["description"]
    assert r.status_code in (200, 400), r.text
    assert schema_accepts(schema, body) == (r.status_code == 200), r.text


async def test_the_document_does_not_grow_with_the_batch() -> None:
    sizes = {}
    for batch in (32, 4096):
        async with serve(FakeRunner(), max_batch_size=batch, max_queue_rows=None) as client:
            r = await client.get("/openapi.json")
        sizes[batch] = len(r.content)
    # One schema per row count up to the batch made it 4,096 copies at 4096 (~100x the size).
    assert sizes[4096] <= 1.2 * sizes[32], sizes


async def test_the_document_is_built_once_per_model() -> None:
    settings = Settings(model="fake", batch_timeout_ms=0, max_batch_size=8, admin_token="tok")

    async def factory(_: Settings) -> FakeRunner:
        return FakeRunner()

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.model().until_ready()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            first = app.openapi()
            served = (await client.get("/openapi.json")).json()
            put = await client.put(
                "/admin/batching",
                json={"max_batch_size": 2, "max_inflight_batches": 1},
                headers={"Authorization": "Bearer tok"},
            )
            after = app.openapi()
    assert put.status_code == 200
    assert after is first and served == first  # not rebuilt per request nor per policy
    predict = first["components"]["schemas"]["PredictRequest"]
    rows = predict["anyOf"][0]["properties"]["instances"]["anyOf"][0]
    assert rows["maxItems"] == 4 * 8 * 2  # the start-up queue, which the PUT kept


def test_every_json_get_route_returns_its_declared_model() -> None:
    from fastapi.routing import APIRoute

    app = create_app(Settings(model="fake", admin_token="tok"))
    gets = [
        r
        for r in app.routes
        if isinstance(r, APIRoute) and "GET" in r.methods and r.include_in_schema
    ]
    undeclared = [r.path for r in gets if r.response_model is None and r.path != "/metrics"]
    assert len(gets) > 10 and undeclared == []
    for route in gets:
        model = route.response_model
        if model is not None:  # a key the body has and the model lacks fails the route
            assert model.model_config.get("extra") == "forbid", route.path


def test_ragged_instances_are_documented_where_the_model_takes_any_length() -> None:
    tokens = ModelSignature(
        "tokens", (TensorSpec("ids", (None,), "int32"),), (TensorSpec("y", (2,), "float32"),)
    )
    schema = predict_schemas(tokens, None)["PredictRequest"]
    assert '"instances" may differ in length' in schema["description"]
    assert schema_accepts(schema, {"instances": [[1, 2, 3], [4]]})
    fixed = predict_schemas(TWO_INPUTS, None)["PredictRequest"]
    assert "differ in length" not in fixed["description"]


async def test_the_document_lists_the_served_models_versions_and_labels(tmp_path: Path) -> None:
    config = '[versions]\npolicy = "all"\n[labels]\nstable = 1\n'
    root = write_repository(tmp_path / "repo", {"a": ([1, 2], config), "b": ([1], "")})
    auth = {"Authorization": "Bearer tok"}
    async with serve_repository(root, Runners(), admin_token="tok") as client:
        doc = (await client.get("/openapi.json")).json()
        await client.post("/v2/repository/models/b/unload", headers=auth)
        after = (await client.get("/openapi.json")).json()
    paths = doc["paths"]

    def enums(path: str, method: str, document: dict[str, Any] = doc) -> dict[str, list[str]]:
        parameters = document["paths"][path][method]["parameters"]
        return {p["name"]: p["schema"]["enum"] for p in parameters if p["in"] == "path"}

    assert enums("/v1/models/{name}/labels/{label}:predict", "post") == {
        "name": ["a", "b"],
        "label": ["stable"],
    }
    assert enums("/v2/models/{name}/versions/{version}/infer", "post")["version"] == ["1", "2"]
    assert enums("/admin/models/{name}/batching", "put") == {"name": ["a", "b"]}
    assert enums("/v1/models/{name}", "get", after) == {"name": ["a"]}  # b unloaded
    # Every version shares the fake's signature: the bodies are its, not the generic ones.
    assert "still loading" not in doc["components"]["schemas"]["PredictRequest"]["description"]
    index = paths["/v2/repository/index"]["post"]
    assert index["requestBody"]["required"] is False
    entry = index["responses"]["200"]["content"]["application/json"]["schema"]["items"]
    assert entry == {"$ref": "#/components/schemas/V2RepositoryEntry"}
    for action in ("load", "unload"):
        operation = paths[f"/v2/repository/models/{{name}}/{action}"]["post"]
        assert operation["security"] == [{"adminToken": []}]
        statuses = ["200", "400", "401", "403", "404", "413", "422", "503"]  # FastAPI's 422
        assert sorted(operation["responses"]) == statuses
