"""The Open Inference Protocol (KServe V2) over HTTP/REST, on the same batcher as ``/predict``.

    GET  /v2                                        server metadata
    GET  /v2/health/live, /v2/health/ready          200 or 503
    GET  /v2/models/{m}[/versions/{v}]              model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready        200 or 503
    GET  /v2/models/{m}[/versions/{v}]/config       the part of Triton's model config clients read
    POST /v2/models/{m}[/versions/{v}]/infer        JSON, or JSON + binary tensors

An infer body is a JSON header, then (binary tensor data extension) the raw bytes of the inputs
that carry ``parameters.binary_data_size``, in input order; ``Inference-Header-Content-Length``
gives the header's length. A response with binary outputs is laid out the same way. The pydantic
models below only document the bodies (OpenAPI): orjson and numpy read the payload.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel

from serving.config import Settings
from serving.errors import (
    InvalidInputError,
    NotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    QueueFullError,
    ShardServeError,
)
from serving.http_io import (
    ClientGone,
    check_content_length,
    check_headroom,
    error_response,
    json_response,
    log_failure,
    read_body,
    request_deadline,
    request_id,
    unexpected_response,
    until_disconnect,
)
from serving.state import ServerState
from serving.v2.datatypes import BINARY_ONLY, DATATYPES, datatype_of
from serving.v2.tensors import decode_tensor, encode_tensor, tensor_config, tensor_metadata
from shards.signature import ModelSignature

__all__ = ["install_v2_routes", "v2_infer"]

SERVER_NAME = "shardserve"
EXTENSIONS = ["binary_tensor_data", "model_configuration"]
PLATFORM = "tensorflow_keras"
VERSION = "1"
HEADER_LENGTH = "inference-header-content-length"
# A JSON header above this is parsed on a worker thread (as /predict decodes big bodies).
_INLINE_DECODE_BYTES = 256 * 1024
_JSON_OPTS = orjson.OPT_SERIALIZE_NUMPY


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.shardserve
    return state


def _check_model(state: ServerState, name: str, version: str | None) -> None:
    served = state.settings.served_name()
    if name != served:
        raise NotFoundError(f"model {name!r} not found; this server serves {served!r}")
    if version is not None and version != VERSION:
        raise NotFoundError(f"model {name!r} has no version {version!r}; its versions: ['1']")


def _not_ready_reason(state: ServerState) -> str | None:
    if state.load_error:
        return f"model failed to load: {state.load_error}"
    if not state.ready.is_set():
        return "model is still loading"
    if not state.accepting:
        return "server is shutting down"
    health = state.runner.health() if state.runner is not None else None
    if health is not None and not health.ok:
        return f"no healthy replica of {health.replicas}; rebuilding"
    return None


# ---- infer: request ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InferCall:
    """A parsed infer request: input arrays by name, outputs asked for (name, as binary)."""

    inputs: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]
    id: str | None
    timeout_s: float | None


def parse_infer(body: bytes, header_length: str | None, signature: ModelSignature) -> InferCall:
    header, binary = _split_body(body, header_length)
    try:
        payload = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"the inference request is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidInputError(
            f'the inference request must be a JSON object with "inputs", got '
            f"{type(payload).__name__}"
        )
    rid = payload.get("id")
    if rid is not None and not isinstance(rid, str):
        raise InvalidInputError(f'"id" must be a string, got {type(rid).__name__}')
    params = _object(payload.get("parameters"), '"parameters"')
    binary_default = _flag(params, "binary_data_output", '"parameters"')
    timeout = params.get("timeout")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool)):
        raise InvalidInputError(
            f'parameter "timeout" is in microseconds (an integer), got {timeout!r}'
        )
    inputs = _inputs(payload.get("inputs"), binary, signature)
    outputs = _outputs(payload.get("outputs"), binary_default, signature)
    return InferCall(inputs, outputs, rid, timeout / 1e6 if timeout else None)


def _split_body(body: bytes, header_length: str | None) -> tuple[memoryview, memoryview]:
    view = memoryview(body)
    if header_length is None:
        return view, view[:0]
    if not (header_length.isascii() and header_length.isdigit()):
        raise InvalidInputError(
            f"header Inference-Header-Content-Length must be the JSON header's length in bytes, "
            f"got {header_length!r}"
        )
    length = int(header_length)
    if length > len(body):
        raise InvalidInputError(
            f"header Inference-Header-Content-Length is {length} but the body has only "
            f"{len(body)} bytes"
        )
    return view[:length], view[length:]


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInputError(f'{where}: "{key}" must be true or false, got {value!r}')
    return value


def _inputs(entries: Any, binary: memoryview, signature: ModelSignature) -> dict[str, np.ndarray]:
    names = signature.input_names
    if not isinstance(entries, list) or not entries:
        raise InvalidInputError(f'"inputs" must be a non-empty list of the model\'s inputs {names}')
    specs = {spec.name: spec for spec in signature.inputs}
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise InvalidInputError(f'"inputs"[{i}] must be an object with a "name" string')
        name = entry["name"]
        spec = specs.get(name)
        if spec is None:
            raise InvalidInputError(f"unknown input {name!r}; the model's inputs are {names}")
        if name in arrays:
            raise InvalidInputError(f"input {name!r} is given twice")
        where = f"input {name!r}"
        params = _object(entry.get("parameters"), f"{where}: parameters")
        if any(key.startswith("shared_memory") for key in params):
            raise InvalidInputError(f"{where} uses shared memory, which this server does not serve")
        size = params.get("binary_data_size")
        data: Any
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidInputError(f"{where}: binary_data_size must be an integer >= 0")
            if "data" in entry:
                raise InvalidInputError(f'{where} has both "data" and binary_data_size; send one')
            if offset + size > len(binary):
                raise InvalidInputError(
                    f"{where} has binary_data_size {size} but only {len(binary) - offset} bytes "
                    "of binary data are left after the JSON header"
                )
            data = binary[offset : offset + size]
            offset += size
        elif "data" in entry:
            data = entry["data"]
        else:
            raise InvalidInputError(f'{where} has neither "data" nor binary_data_size')
        arrays[name] = decode_tensor(name, entry.get("datatype"), entry.get("shape"), data, spec)
    if offset != len(binary):
        raise InvalidInputError(
            f"the body has {len(binary) - offset} bytes after the JSON header that no input's "
            "binary_data_size accounts for"
        )
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {names}")
    rows = {name: arr.shape[0] for name, arr in arrays.items()}
    if len(set(rows.values())) != 1:
        raise InvalidInputError(f"inputs have different row counts {rows}; all must be equal")
    return arrays


def _outputs(
    entries: Any, binary_default: bool, signature: ModelSignature
) -> list[tuple[str, bool]]:
    names = signature.output_names
    if not entries:  # absent or []: every output
        asked = [(name, binary_default) for name in names]
    else:
        if not isinstance(entries, list):
            raise InvalidInputError(
                f'"outputs" must be a list of objects, got {type(entries).__name__}'
            )
        asked = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise InvalidInputError(f'"outputs"[{i}] must be an object with a "name" string')
            name = entry["name"]
            if name not in names:
                raise InvalidInputError(f"unknown output {name!r}; the model's outputs are {names}")
            if any(name == seen for seen, _ in asked):
                raise InvalidInputError(f"output {name!r} is asked for twice")
            params = _object(entry.get("parameters"), f"output {name!r}: parameters")
            if params.get("classification") or any(k.startswith("shared_memory") for k in params):
                raise InvalidInputError(
                    f"output {name!r}: classification and shared memory are not served"
                )
            binary = _flag(params, "binary_data", f"output {name!r}: parameters")
            asked.append((name, binary if "binary_data" in params else binary_default))
    specs = {spec.name: spec for spec in signature.outputs}
    for name, binary in asked:
        datatype = datatype_of(specs[name].dtype)
        if not binary and datatype in BINARY_ONLY:
            raise InvalidInputError(
                f"output {name!r} is {datatype}, which JSON cannot carry; ask for it as binary "
                'data (output parameter "binary_data": true)'
            )
    return asked


# ---- infer: response --------------------------------------------------------------------------


def encode_infer(
    outputs: dict[str, np.ndarray], call: InferCall, signature: ModelSignature, model_name: str
) -> Response:
    specs = {spec.name: spec for spec in signature.outputs}
    entries: list[dict[str, Any]] = []
    buffers: list[memoryview] = []
    for name, binary in call.outputs:
        tensor = encode_tensor(name, outputs[name], specs[name])
        entry: dict[str, Any] = {"name": name, "datatype": tensor.datatype, "shape": tensor.shape}
        if binary:
            entry["parameters"] = {"binary_data_size": tensor.array.nbytes}
            buffers.append(tensor.buffer())
        else:
            entry["data"] = tensor.flat()
        entries.append(entry)
    body: dict[str, Any] = {"model_name": model_name, "model_version": VERSION}
    if call.id is not None:
        body["id"] = call.id
    body["outputs"] = entries
    header = orjson.dumps(body, option=_JSON_OPTS)
    if not buffers:
        return Response(header, media_type="application/json")
    return Response(
        b"".join([header, *buffers]),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


async def v2_infer(name: str, version: str | None, request: Request) -> Response:
    """``POST /v2/models/{name}[/versions/{version}]/infer``; maps its own errors (fast path)."""
    state = _state(request)
    settings = state.settings
    started = time.perf_counter()
    status = "500"
    rid = request_id(request)
    try:
        _check_model(state, name, version)
        batcher = state.require_batcher()
        runner = state.runner
        assert runner is not None
        # Admission from the headers alone: a refused request costs no body read, no decode.
        check_content_length(request, settings.max_body_bytes)
        try:
            check_headroom(batcher)
        except QueueFullError:
            state.metrics.rejects.labels("queue_full").inc()
            raise
        deadline = request_deadline(request, settings)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise InvalidInputError(
                f"Content-Encoding {encoding!r} is not served; send the body uncompressed"
            )
        body = await read_body(request, settings.max_body_bytes)
        header_length = request.headers.get(HEADER_LENGTH)
        json_bytes = len(body) if header_length is None else min(len(body), _int(header_length))
        if json_bytes > _INLINE_DECODE_BYTES:
            call = await asyncio.to_thread(parse_infer, body, header_length, runner.signature)
        else:
            call = parse_infer(body, header_length, runner.signature)
        if call.timeout_s is not None:
            deadline = min(deadline, time.monotonic() + call.timeout_s)
        outputs = await until_disconnect(
            request, batcher.submit(call.inputs, deadline=deadline, request_id=rid)
        )
        response = encode_infer(outputs, call, runner.signature, name)
        status = "200"
        return response
    except ClientGone:
        status = "499"
        state.metrics.rejects.labels("client_gone").inc()
        log_failure(rid, 499, "the client went away before its answer was ready")
        return Response(status_code=499)
    except ShardServeError as exc:
        status = str(exc.status_code)
        if isinstance(exc, InvalidInputError | PayloadTooLargeError):
            state.metrics.rejects.labels("invalid_input").inc()
        return error_response(exc, rid)
    except Exception as exc:
        return unexpected_response(request, exc)
    finally:
        state.metrics.request_latency.labels(status).observe(time.perf_counter() - started)


def _int(text: str) -> int:
    return int(text) if text.isascii() and text.isdigit() else 0


# ---- metadata, health, config -----------------------------------------------------------------


def server_metadata() -> dict[str, Any]:
    return {
        "name": SERVER_NAME,
        "version": importlib.metadata.version("shardserve"),
        "extensions": EXTENSIONS,
    }


def model_metadata(name: str, signature: ModelSignature) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": [tensor_metadata(spec) for spec in signature.inputs],
        "outputs": [tensor_metadata(spec) for spec in signature.outputs],
    }


def model_config(state: ServerState, name: str, signature: ModelSignature) -> dict[str, Any]:
    settings = state.settings
    policy = state.batcher.policy if state.batcher is not None else None
    max_batch = policy.max_batch_size if policy is not None else settings.max_batch_size
    wait_ms = policy.batch_timeout_ms if policy is not None else None
    if policy is None and not settings.timeout_is_auto:
        wait_ms = float(settings.batch_timeout_ms)
    batching: dict[str, Any] = {}
    if wait_ms is not None:  # None: the adaptive (auto) wait
        batching["max_queue_delay_microseconds"] = round(wait_ms * 1000)
    return {
        "name": name,
        "platform": PLATFORM,
        "backend": SERVER_NAME,
        "max_batch_size": max_batch,
        "input": [tensor_config(spec) for spec in signature.inputs],
        "output": [tensor_config(spec) for spec in signature.outputs],
        "dynamic_batching": batching,
    }


def _signature(state: ServerState) -> ModelSignature:
    if state.runner is None:
        raise NotReadyError("model is still loading; its signature is not known yet")
    return state.runner.signature


def install_v2_routes(app: FastAPI, settings: Settings) -> None:
    """The V2 routes. They read ``settings`` from the app state at request time, as the fast
    path's direct call of ``v2_infer`` must."""
    Doc = dict[int | str, dict[str, Any]]
    errors: Doc = {code: {"model": ErrorBody} for code in (400, 404, 413, 422, 500, 503, 504)}
    loading: Doc = {404: {"model": ErrorBody}, 503: {"model": ErrorBody}}

    @app.get("/v2", responses={200: {"model": ServerMetadata}}, tags=["v2"])
    async def v2_server_metadata() -> Response:
        return json_response(server_metadata())

    @app.get("/v2/health/live", responses={200: {"model": LiveResponse}}, tags=["v2"])
    async def v2_live() -> Response:
        return json_response({"live": True})

    @app.get(
        "/v2/health/ready",
        responses={200: {"model": ReadyResponse}, 503: {"model": ReadyResponse}},
        tags=["v2"],
    )
    async def v2_ready(request: Request) -> Response:
        ready = _not_ready_reason(_state(request)) is None
        return json_response({"ready": ready}, 200 if ready else 503)

    async def metadata(name: str, request: Request, version: str | None = None) -> Response:
        state = _state(request)
        _check_model(state, name, version)
        return json_response(model_metadata(name, _signature(state)))

    async def metadata_v(name: str, version: str, request: Request) -> Response:
        return await metadata(name, request, version)

    async def ready(name: str, request: Request, version: str | None = None) -> Response:
        state = _state(request)
        _check_model(state, name, version)
        ok = _not_ready_reason(state) is None
        return json_response({"name": name, "ready": ok}, 200 if ok else 503)

    async def ready_v(name: str, version: str, request: Request) -> Response:
        return await ready(name, request, version)

    async def config(name: str, request: Request, version: str | None = None) -> Response:
        state = _state(request)
        _check_model(state, name, version)
        return json_response(model_config(state, name, _signature(state)))

    async def config_v(name: str, version: str, request: Request) -> Response:
        return await config(name, request, version)

    async def infer(name: str, request: Request) -> Response:
        return await v2_infer(name, None, request)

    async def infer_v(name: str, version: str, request: Request) -> Response:
        return await v2_infer(name, version, request)

    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    ready_doc: Doc = {
        200: {"model": ModelReadyResponse},
        404: {"model": ErrorBody},
        503: {"model": ModelReadyResponse},
    }
    for prefix, suffix in ((model, ""), (versioned, "_v")):
        v = suffix == "_v"
        app.add_api_route(
            prefix,
            metadata_v if v else metadata,
            methods=["GET"],
            responses={200: {"model": ModelMetadata}, **loading},
            tags=["v2"],
            name=f"v2_model_metadata{suffix}",
        )
        app.add_api_route(
            f"{prefix}/ready",
            ready_v if v else ready,
            methods=["GET"],
            responses=ready_doc,
            tags=["v2"],
            name=f"v2_model_ready{suffix}",
        )
        app.add_api_route(
            f"{prefix}/config",
            config_v if v else config,
            methods=["GET"],
            responses={200: {"model": ModelConfig}, **loading},
            tags=["v2"],
            name=f"v2_model_config{suffix}",
        )
        app.add_api_route(
            f"{prefix}/infer",
            infer_v if v else infer,
            methods=["POST"],
            responses={200: _INFER_OK, **errors},
            openapi_extra=_INFER_REQUEST_DOC,
            tags=["v2"],
            name=f"v2_infer{suffix}",
        )


# ---- OpenAPI documentation of the bodies (never used to parse them) ---------------------------

Datatype = Literal[DATATYPES]  # type: ignore[valid-type]


class ErrorBody(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class LiveResponse(BaseModel):
    live: bool


class ReadyResponse(BaseModel):
    ready: bool


class ModelReadyResponse(BaseModel):
    name: str
    ready: bool


class TensorMetadata(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ConfigTensor(BaseModel):
    name: str
    data_type: str
    dims: list[int]


class DynamicBatching(BaseModel):
    max_queue_delay_microseconds: int | None = None


class ModelConfig(BaseModel):
    name: str
    platform: str
    backend: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: DynamicBatching


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: Datatype
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


def _inline(schema: Any, defs: dict[str, Any]) -> Any:
    """``schema`` with its ``#/$defs/...`` references replaced by the definitions themselves."""
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline(v, defs) for v in schema]
    return schema


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    inlined: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return inlined


_BINARY_BODY = {
    "schema": {"type": "string", "format": "binary"},
    "description": "The JSON object (its length in Inference-Header-Content-Length), then the "
    "raw little-endian bytes of each binary tensor in order",
}
_INFER_REQUEST_DOC: dict[str, Any] = {
    "parameters": [
        {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "description": "Length in bytes of the JSON object when binary tensor data follow it",
            "schema": {"type": "integer", "minimum": 0},
        }
    ],
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _schema(InferenceRequest)},
            "application/octet-stream": _BINARY_BODY,
        },
    },
}
_INFER_OK: dict[str, Any] = {
    "model": InferenceResponse,
    "description": "The outputs; with binary outputs, the JSON object then their bytes",
    "content": {"application/octet-stream": _BINARY_BODY},
    "headers": {
        "Inference-Header-Content-Length": {
            "description": "Length of the JSON object when binary tensor data follow it",
            "schema": {"type": "integer"},
        }
    },
}
