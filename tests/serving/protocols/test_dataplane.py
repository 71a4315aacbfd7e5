"""The data plane (serving.protocols.dataplane, over HTTP: serving.protocols.rest) knows a model
only as a ``ModelHandle`` found in a ``ModelDirectory``: here both are fakes, with no app,
server or batcher behind them. Admission refuses from the headers alone (the body is never
read), and every answer is counted on the model it was for."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from serving.errors import (
    BatchAbandonedError,
    BatchFailedError,
    DeadlineExceededError,
    InvalidInputError,
    ModelInputError,
    NotFoundError,
    NotReadyError,
    QueueFullError,
)
from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import JSON, Reply
from serving.protocols.rest import serve_prediction
from serving.settings.config import Settings
from serving.version.admitted import Admitted
from shards.signature import ModelSignature


@dataclass
class Limits:
    max_queue_rows: int = 4


@dataclass
class Batcher:
    queued_rows: int = 0
    settings: Limits = field(default_factory=Limits)


@dataclass
class Metrics:
    rejects: list[str] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    routed: list[bool] = field(default_factory=list)  # what a canary's judge was told

    def reject(self, reason: str) -> None:
        self.rejects.append(reason)

    def observe_latency(self, status: int, seconds: float) -> None:
        self.statuses.append(status)

    def observe_routed(self, failed: bool, seconds: float) -> None:
        self.routed.append(failed)


@dataclass
class Model:
    name: str = "m"
    version: str = "1"
    settings: Settings = field(default_factory=lambda: Settings(model="m", max_body_bytes=1024))
    metrics: Metrics = field(default_factory=Metrics)
    batcher: Any = field(default_factory=Batcher)
    signature: ModelSignature = field(default_factory=lambda: ModelSignature("m", (), ()))
    loading: bool = False
    body_reads: int = 0
    admitted: Admitted = field(default_factory=Admitted)

    def require_batcher(self) -> Any:
        if self.loading:
            raise NotReadyError("model is still loading")
        return self.batcher

    def not_ready_reason(self) -> str | None:
        return "model is still loading" if self.loading else None


@dataclass
class Directory:
    served: Model
    asked: list[tuple[str | None, str | None, str | None]] = field(default_factory=list)

    def model(
        self, name: str | None = None, version: str | None = None, label: str | None = None
    ) -> Model:
        self.asked.append((name, version, label))
        if name not in (None, self.served.name):
            raise NotFoundError(f"model {name!r} not found; this server serves 'm'")
        return self.served

    def not_ready_reason(self) -> str | None:
        return self.served.not_ready_reason()


M = ModelRef("m")


async def call(
    model: Model,
    ref: ModelRef = M,
    directory: Directory | None = None,
    raises: Exception | None = None,
    **headers: str,
) -> tuple[int, dict[bytes, bytes], Any]:
    """POST a small body to a predict route of ``model`` whose work echoes the body (or
    raises ``raises``)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        model.body_reads += 1
        return {"type": "http.request", "body": b'{"a": 1.0}', "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def work(request: FastRequest, handle: Any, batcher: Any, deadline: float) -> Reply:
        assert handle is model and batcher is model.batcher
        if raises is not None:
            raise raises
        return 200, await request.body(handle.settings.max_body_bytes, 30.0), JSON, []

    raw = [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "method": "POST", "path": "/p", "headers": raw}
    models = directory or Directory(model)
    await serve_prediction(FastRequest(scope, receive, send), models, ref, work)
    start, body = sent
    got = dict(start["headers"])
    return start["status"], got, (orjson.loads(body["body"]) if body["body"] else None)


async def test_a_model_handle_is_served_and_counted() -> None:
    model = Model()
    status, headers, body = await call(model, X_Request_Id="r-7")
    assert (status, body, headers[b"x-request-id"]) == (200, {"a": 1.0}, b"r-7")
    assert model.metrics.statuses == [200] and model.metrics.rejects == []


OWN = "; leave it out for the server's deadline (request_timeout_ms=30000)"


@pytest.mark.parametrize(
    ("change", "headers", "status", "reason", "message"),
    [
        ({}, {"Content_Length": "1025"}, 413, "invalid_input", "body of 1025 bytes is over the limit of 1024 bytes"),
        ({"batcher": Batcher(queued_rows=4)}, {}, 503, "queue_full", "queue full: 4 rows queued, max_queue_rows=4"),
        ({"loading": True}, {}, 503, None, "model is still loading"),
        ({}, {"X_Request_Timeout_Ms": "0"}, 400, "invalid_input", f"header X-Request-Timeout-Ms must be a positive, finite number of ms, got '0'{OWN}"),
        ({}, {"X_Request_Timeout_Ms": "-5"}, 400, "invalid_input", f"header X-Request-Timeout-Ms must be a positive, finite number of ms, got '-5'{OWN}"),
        ({}, {"X_Request_Timeout_Ms": "inf"}, 400, "invalid_input", f"header X-Request-Timeout-Ms must be a positive, finite number of ms, got 'inf'{OWN}"),
        ({}, {"X_Request_Timeout_Ms": "NaN"}, 400, "invalid_input", f"header X-Request-Timeout-Ms must be a positive, finite number of ms, got 'NaN'{OWN}"),
    ],
)  # fmt: skip
async def test_admission_refuses_from_the_headers(
    change: dict[str, Any], headers: dict[str, str], status: int, reason: str | None, message: str
) -> None:
    model = Model(**change)
    got, sent_headers, body = await call(model, **headers)
    assert (got, body) == (status, {"error": message})
    assert model.metrics.rejects == ([reason] if reason else [])
    assert model.metrics.statuses == [status]
    assert model.body_reads == 0
    if reason == "queue_full":
        assert sent_headers[b"retry-after"] == b"1"


@pytest.mark.parametrize(
    ("raises", "timeout_ms", "told"),
    [
        (None, None, [False]),
        (ModelInputError("the model failed on this input"), None, [True]),
        (BatchFailedError("model failed on a batch of 1 rows"), None, [True]),
        (NotReadyError("the model is unavailable: no healthy replica of 1"), None, [True]),
        # A 500 outside the runner (whose errors the batcher names): the front end's, the same
        # code for both versions.
        (RuntimeError("a bug"), None, []),
        (BatchAbandonedError("the request's batch was abandoned"), "0.001", [True]),
        # The client's own choices: not the version's doing.
        (DeadlineExceededError("the request's deadline passed in the queue"), "0.001", []),
        (QueueFullError("queue full: 4 rows queued, 4 more would pass max_queue_rows=4"), None, []),
        (InvalidInputError("input 'x' has shape (3,); expected (n, 4)"), None, []),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
async def test_a_canary_judge_is_told_only_what_the_version_did(
    raises: Exception | None, timeout_ms: str | None, told: list[bool]
) -> None:
    headers = {} if timeout_ms is None else {"X_Request_Timeout_Ms": timeout_ms}
    routed, named = Model(), Model()
    await call(routed, ModelRef("m"), raises=raises, **headers)
    await call(named, ModelRef("m", "1"), raises=raises, **headers)
    assert routed.metrics.routed == told
    assert named.metrics.routed == []  # named its version: the split did not route it
    assert len(routed.metrics.statuses) == len(named.metrics.statuses) == 1


async def test_a_504_past_the_servers_own_deadline_is_the_versions_failure() -> None:
    model = Model(settings=Settings(model="m", request_timeout_ms=1))

    async def late(request: FastRequest, handle: Any, batcher: Any, deadline: float) -> Reply:
        while time.monotonic() < deadline:  # the server's own deadline: no header shortened it
            await asyncio.sleep(deadline - time.monotonic())
        raise DeadlineExceededError("the request's deadline passed in the queue")

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/p", "headers": []}
    await serve_prediction(FastRequest(scope, None, send), Directory(model), M, late)  # type: ignore[arg-type]
    assert model.metrics.statuses == [504] and model.metrics.routed == [True]


async def test_an_unknown_model_is_404_and_counted_on_none() -> None:
    model = Model()
    status, _, body = await call(model, ModelRef("nope"))
    assert (status, body) == (404, {"error": "model 'nope' not found; this server serves 'm'"})
    assert model.metrics.statuses == []


@pytest.mark.parametrize(
    "ref", [ModelRef(None), ModelRef("m", "2"), ModelRef("m", label="stable")], ids=str
)
async def test_the_version_or_label_a_path_names_reaches_the_directory(ref: ModelRef) -> None:
    model = Model()
    directory = Directory(model)
    status, _, _ = await call(model, ref, directory)
    assert status == 200
    assert directory.asked == [(ref.name, ref.version, ref.label)]


async def test_a_request_admitted_before_its_body_arrived_holds_the_models_drain() -> None:
    model = Model()
    rest = asyncio.Event()
    chunks = [(b'{"a": ', True), (b"1.0}", False)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if len(chunks) == 1:
            await rest.wait()  # the body's second half is slow to come
        body, more = chunks.pop(0)
        return {"type": "http.request", "body": body, "more_body": more}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def work(request: FastRequest, handle: Any, batcher: Any, deadline: float) -> Reply:
        return 200, await request.body(handle.settings.max_body_bytes, 30.0), JSON, []

    scope = {"type": "http", "method": "POST", "path": "/p", "headers": []}
    request = asyncio.create_task(
        serve_prediction(FastRequest(scope, receive, send), Directory(model), M, work)
    )
    while model.admitted.count == 0:
        await asyncio.sleep(0)
    drained = asyncio.create_task(model.admitted.wait_idle(30))
    await asyncio.sleep(0.01)
    assert not drained.done()  # a drain now would refuse a request already admitted
    rest.set()
    await request
    assert await drained is True
    assert sent[0]["status"] == 200 and orjson.loads(sent[1]["body"]) == {"a": 1.0}
    assert await Admitted().wait_idle(0) is True  # none held: at once
