"""The Open Inference Protocol (KServe V2) over gRPC: ``inference.GRPCInferenceService``.

Served by ``grpc.aio`` in the HTTP server's process and event loop (the lifespan starts and stops
it), on the same batcher, admission, tensor checks and metrics as ``/v2/.../infer``. Raw contents
become arrays with ``np.frombuffer``; typed ``contents`` go through the JSON path's list checks.
Answers carry every output in ``raw_output_contents``. Errors are the call's status:

    InvalidInputError, ModelInputError    INVALID_ARGUMENT
    NotFoundError                         NOT_FOUND
    QueueFullError, NotReadyError         UNAVAILABLE
    DeadlineExceededError                 DEADLINE_EXCEEDED (the client's deadline is the batcher's)
    BatchFailedError, anything else       INTERNAL
    a message over max_body_bytes         RESOURCE_EXHAUSTED (refused by gRPC before decoding)
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypeAlias

import grpc
import numpy as np
from google.protobuf import json_format

from serving.errors import (
    BatchFailedError,
    DeadlineExceededError,
    ForbiddenError,
    InvalidInputError,
    ModelInputError,
    NotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    QueueFullError,
    ShardServeError,
    UnauthorizedError,
)
from serving.http.replies import check_headroom, log_failure, request_id_from
from serving.protocols.v2.datatypes import datatype_of
from serving.protocols.v2.http import (
    VERSION,
    _check_model,
    _not_ready_reason,
    model_config,
    model_metadata,
    server_metadata,
)
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc
from serving.protocols.v2.tensors import decode_tensor, encode_tensor
from serving.server.state import ServerState
from shards.signature import ModelSignature, TensorSpec

log = logging.getLogger("shardserve")
_Context: TypeAlias = grpc.aio.ServicerContext

_CODES: dict[type[ShardServeError], grpc.StatusCode] = {
    InvalidInputError: grpc.StatusCode.INVALID_ARGUMENT,
    ModelInputError: grpc.StatusCode.INVALID_ARGUMENT,
    PayloadTooLargeError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnauthorizedError: grpc.StatusCode.UNAUTHENTICATED,
    ForbiddenError: grpc.StatusCode.PERMISSION_DENIED,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    QueueFullError: grpc.StatusCode.UNAVAILABLE,
    NotReadyError: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    BatchFailedError: grpc.StatusCode.INTERNAL,
}

# The typed field of ``InferTensorContents`` that carries each datatype (FP16, BF16: raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def status_code(exc: ShardServeError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def rpc_deadline(time_remaining: float | None, request_timeout_ms: float) -> float:
    """The batcher's deadline (``time.monotonic()``): the client's, or the server's if sooner."""
    timeout_s = request_timeout_ms / 1000.0
    if time_remaining is not None:
        timeout_s = min(timeout_s, max(0.0, time_remaining))
    return time.monotonic() + timeout_s


def decode_inputs(request: pb.ModelInferRequest, signature: ModelSignature) -> dict[str, Any]:
    names = signature.input_names
    specs = {spec.name: spec for spec in signature.inputs}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
            "give one per input, in the order of inputs"
        )
    arrays: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        spec = specs.get(name)
        if spec is None:
            raise InvalidInputError(f"unknown input {name!r}; the model's inputs are {names}")
        if name in arrays:
            raise InvalidInputError(f"input {name!r} is given twice")
        if any(key.startswith("shared_memory") for key in tensor.parameters):
            raise InvalidInputError(
                f"input {name!r} uses shared memory, which this server does not serve"
            )
        data: Any
        if raw:
            if tensor.HasField("contents"):
                raise InvalidInputError(
                    f"input {name!r} has contents while raw_input_contents is given; "
                    "send every input one way"
                )
            data = raw[i]
        else:
            data = _typed_contents(tensor, spec)
        arrays[name] = decode_tensor(name, tensor.datatype, list(tensor.shape), data, spec)
    missing = [name for name in names if name not in arrays]
    if missing:
        raise InvalidInputError(f"missing input(s) {missing}; the model's inputs are {names}")
    return arrays


def _typed_contents(tensor: pb.ModelInferRequest.InferInputTensor, spec: TensorSpec) -> Any:
    where = f"input {tensor.name!r}"
    field = _CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        if tensor.datatype == datatype_of(spec.dtype):
            raise InvalidInputError(
                f"{where} is {tensor.datatype}, which has no typed field in contents; "
                "send its bytes in raw_input_contents"
            )
        return []  # decode_tensor refuses the datatype, naming the model's
    sent = [f.name for f, _ in tensor.contents.ListFields()]
    if any(name != field for name in sent):
        raise InvalidInputError(
            f"{where} is {tensor.datatype}, whose elements go in contents.{field}; "
            f"got contents.{', contents.'.join(sent)}"
        )
    return list(getattr(tensor.contents, field))


def requested_outputs(request: pb.ModelInferRequest, signature: ModelSignature) -> list[str]:
    names = signature.output_names
    if not request.outputs:
        return names
    asked: list[str] = []
    for output in request.outputs:
        if output.name not in names:
            raise InvalidInputError(
                f"unknown output {output.name!r}; the model's outputs are {names}"
            )
        if output.name in asked:
            raise InvalidInputError(f"output {output.name!r} is asked for twice")
        params = output.parameters
        if "classification" in params or any(k.startswith("shared_memory") for k in params):
            raise InvalidInputError(
                f"output {output.name!r}: classification and shared memory are not served"
            )
        asked.append(output.name)
    return asked


def request_timeout_s(request: pb.ModelInferRequest) -> float | None:
    """Triton's ``timeout`` request parameter (microseconds), if given."""
    param = request.parameters.get("timeout")
    if param is None:
        return None
    kind = param.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidInputError(
            f'parameter "timeout" is in microseconds (an integer), got a {kind or "empty value"}'
        )
    micros = int(getattr(param, kind))
    return micros / 1e6 if micros > 0 else None


def encode_outputs(
    outputs: dict[str, np.ndarray], names: list[str], signature: ModelSignature
) -> tuple[list[pb.ModelInferResponse.InferOutputTensor], list[bytes]]:
    specs = {spec.name: spec for spec in signature.outputs}
    tensors, raw = [], []
    for name in names:
        tensor = encode_tensor(name, outputs[name], specs[name])
        tensors.append(
            pb.ModelInferResponse.InferOutputTensor(
                name=name, datatype=tensor.datatype, shape=tensor.shape
            )
        )
        raw.append(tensor.array.tobytes())
    return tensors, raw


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: ServerState) -> None:
        self._state = state

    async def ServerLive(self, request: pb.ServerLiveRequest, context: _Context) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: _Context) -> Any:
        return pb.ServerReadyResponse(ready=_not_ready_reason(self._state) is None)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: _Context) -> Any:
        return json_format.ParseDict(server_metadata(), pb.ServerMetadataResponse())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: _Context) -> Any:
        await self._signature(context, request.name, request.version)
        return pb.ModelReadyResponse(ready=_not_ready_reason(self._state) is None)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: _Context) -> Any:
        signature = await self._signature(context, request.name, request.version, loaded=True)
        metadata = model_metadata(request.name, signature)
        return json_format.ParseDict(metadata, pb.ModelMetadataResponse())

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: _Context) -> Any:
        signature = await self._signature(context, request.name, request.version, loaded=True)
        config = model_config(self._state, request.name, signature)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: _Context) -> Any:
        state = self._state
        started = time.perf_counter()
        status = "500"
        rid = _request_id(context)
        error: ShardServeError | None = None
        try:
            _check_model(state, request.model_name, request.model_version or None)
            batcher = state.require_batcher()
            runner = state.runner
            assert runner is not None
            try:
                check_headroom(batcher)
            except QueueFullError:
                state.metrics.rejects.labels("queue_full").inc()
                raise
            deadline = rpc_deadline(context.time_remaining(), state.settings.request_timeout_ms)
            timeout_s = request_timeout_s(request)
            if timeout_s is not None:
                deadline = min(deadline, time.monotonic() + timeout_s)
            inputs = decode_inputs(request, runner.signature)
            names = requested_outputs(request, runner.signature)
            outputs = await batcher.submit(inputs, deadline=deadline, request_id=rid)
            tensors, raw = encode_outputs(outputs, names, runner.signature)
            status = "200"
            context.set_trailing_metadata((("x-request-id", rid),))
            return pb.ModelInferResponse(
                model_name=request.model_name,
                model_version=VERSION,
                id=request.id,
                outputs=tensors,
                raw_output_contents=raw,
            )
        except ShardServeError as exc:
            status = str(exc.status_code)
            if isinstance(exc, InvalidInputError | PayloadTooLargeError):
                state.metrics.rejects.labels("invalid_input").inc()
            error = exc
        except Exception:
            log.exception("request %s: unexpected error in ModelInfer", rid)
        except BaseException:  # cancelled: the client went away or its deadline passed
            status = "499"
            state.metrics.rejects.labels("client_gone").inc()
            raise
        finally:
            state.metrics.request_latency.labels(status).observe(time.perf_counter() - started)
        await _abort(context, error, rid)

    async def _signature(
        self, context: _Context, name: str, version: str, *, loaded: bool = False
    ) -> ModelSignature:
        state = self._state
        try:
            _check_model(state, name, version or None)
            if loaded and state.runner is None:
                raise NotReadyError("model is still loading; its signature is not known yet")
        except ShardServeError as exc:
            await _abort(context, exc, "-")
        return state.runner.signature if state.runner is not None else ModelSignature("", (), ())


def _request_id(context: _Context) -> str:
    metadata = context.invocation_metadata() or ()
    headers = [(k.encode(), v.encode()) for k, v in metadata if isinstance(v, str)]
    return request_id_from(headers).decode()


async def _abort(context: _Context, error: ShardServeError | None, rid: str) -> None:
    """End the call with the error's status (``None``: an unexpected error, INTERNAL)."""
    if error is None:
        code, message = grpc.StatusCode.INTERNAL, "internal server error; see the server log"
        log_failure(rid, 500, message)
    else:
        code, message = status_code(error), error.message
        log_failure(rid, error.status_code, message)
    await context.abort(code, message, trailing_metadata=(("x-request-id", rid),))


async def start_grpc_server(state: ServerState) -> grpc.aio.Server | None:
    """Serve gRPC on ``settings.grpc_port`` in the running event loop (``None`` when it is 0)."""
    settings = state.settings
    if not settings.grpc_port:
        return None
    server = grpc.aio.server(
        options=[
            # The body cap of HTTP: a bigger message is refused before it is decoded.
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            # gRPC shares a busy port by default (SO_REUSEPORT): make it an error instead.
            ("grpc.so_reuseport", 0),
        ]
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(state), server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        server.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(
            f"cannot serve gRPC on {address}: the port is in use or not allowed; "
            "choose another with --grpc-port, or 0 to turn gRPC off"
        ) from None
    await server.start()
    log.info("gRPC (Open Inference Protocol) on %s", address)
    return server


async def stop_grpc_server(server: grpc.aio.Server | None, *, grace_s: float) -> None:
    """New calls are refused at once; calls still open get ``grace_s`` (what is left of the
    stop budget's answer phase: their rows were answered or failed by then) to finish."""
    if server is not None:
        await server.stop(grace_s)
