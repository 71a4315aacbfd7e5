"""The Open Inference Protocol (KServe V2) over gRPC: ``inference.GRPCInferenceService``.

Served by ``grpc.aio`` in the HTTP server's process and event loop (the lifespan starts and stops
it), on the same batcher, admission, tensor checks and metrics as ``/v2/.../infer``; messages to
arrays and back in ``grpc_codec``. A call's ``model_version`` (``version``) picks the version of
the model it names; empty, the server's choice (its highest ready version). The model
repository's calls (index, load, unload) are in ``grpc_repository``. Errors are the call's status:

    InvalidInputError, ModelInputError    INVALID_ARGUMENT
    UnauthorizedError                     UNAUTHENTICATED (load/unload without the admin token)
    ForbiddenError                        PERMISSION_DENIED (a wrong admin token)
    NotFoundError                         NOT_FOUND
    QueueFullError, NotReadyError         UNAVAILABLE
    DeadlineExceededError                 DEADLINE_EXCEEDED (the client's deadline is the batcher's)
    BatchFailedError, anything else       INTERNAL
    a message over max_body_bytes         RESOURCE_EXHAUSTED (refused by gRPC before decoding)
    more inputs or values than fit        INVALID_ARGUMENT (before it is parsed: ``grpc_bounds``)
    bytes that are no ModelInferRequest   INVALID_ARGUMENT (gRPC's own answer was UNKNOWN)
    a call past grpc_max_concurrent_rpcs  RESOURCE_EXHAUSTED (refused by gRPC before reading it)

Every call's trailing metadata carries its ``x-request-id``; a refusal with a retry hint (a full
queue, no healthy replica now) carries ``retry-after`` too, whole seconds as a string: HTTP's
``Retry-After`` header, the same value. ``ModelInfer`` is the data plane's
(``serving.protocols.dataplane.infer``: look-up, admission, deadline, the admission held across
decode and submit, the same rejects, latency and canary metrics as HTTP's), with gRPC's
transport (``_Grpc``): the call's deadline, and its answer or status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

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
from serving.http.model import ModelDirectory, ModelHandle
from serving.http.replies import log_failure, request_id_from, retry_after_seconds
from serving.protocols.dataplane import Failure, check_sequence_length, count_refused, infer
from serving.protocols.limits import request_limits
from serving.protocols.v2.grpc_bounds import InferBounds, scan_infer_request
from serving.protocols.v2.grpc_codec import (
    decode_inputs,
    encode_outputs,
    request_timeout_s,
    requested_outputs,
)
from serving.protocols.v2.grpc_repository import Metadata, RepositoryRpcs, RepositorySource
from serving.protocols.v2.metadata import model_config, model_metadata, server_metadata
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.protocols.v2.proto import grpc_service_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.settings.config import Settings

log = logging.getLogger("shardserve")
RETRY_AFTER_KEY = "retry-after"
_Context: TypeAlias = grpc.aio.ServicerContext
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")

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


def _no_repository() -> None:
    return None


@dataclass(frozen=True)
class Refused:
    """What ``ModelInfer`` gets instead of a message refused before it was parsed (a
    deserializer that raised would end the call UNKNOWN, not with the refusal's status)."""

    error: ShardServeError
    model: ModelHandle | None  # the model it named, where there is one


class _Handlers:
    """Takes the generated stubs' method handlers in place of a server, so that one can be
    replaced before the server gets them (the registered handlers win over a generic one)."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, dict(handlers)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: ModelDirectory, repository: RepositoryRpcs) -> None:
        self._models = models
        self._repository = repository

    async def ServerLive(self, request: pb.ServerLiveRequest, context: _Context) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: _Context) -> Any:
        return pb.ServerReadyResponse(ready=self._models.not_ready_reason() is None)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: _Context) -> Any:
        return json_format.ParseDict(server_metadata(), pb.ServerMetadataResponse())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: _Context) -> Any:
        model = await self._model(context, request.name, request.version)
        return pb.ModelReadyResponse(ready=model.not_ready_reason() is None)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: _Context) -> Any:
        model = await self._model(context, request.name, request.version)
        versions = self._models.versions(model.name)
        metadata = await _answer(context, lambda m: model_metadata(m, versions), model)
        metadata.pop("parameters", None)  # the message has no such field (HTTP's JSON has)
        return json_format.ParseDict(metadata, pb.ModelMetadataResponse())

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: _Context) -> Any:
        model = await self._model(context, request.name, request.version)
        config = await _answer(context, model_config, model)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    def read_infer(self, data: bytes) -> pb.ModelInferRequest | Refused:
        """``ModelInfer``'s deserializer: the message, or its refusal where it holds more than
        a request to the model it names could (``grpc_bounds``), before protobuf parses it."""
        named: list[ModelHandle] = []

        def bounds_of(name: str, version: str) -> InferBounds:
            model = self._models.model(name, version or None, split=False)
            named.append(model)
            limits = request_limits(model, model.require_batcher())
            return InferBounds.of(model.name, model.signature, limits)

        try:
            scan_infer_request(data, bounds_of)
            return pb.ModelInferRequest.FromString(data)
        except ShardServeError as exc:
            return Refused(exc, named[-1] if named else None)
        except DecodeError:  # a string that is not UTF-8, a broken parameter: gRPC says UNKNOWN
            invalid = InvalidInputError(
                "the message is not a valid ModelInferRequest (protobuf could not parse it); "
                "send one your client's V2 (KServe, Triton) stubs serialize"
            )
            return Refused(invalid, named[-1] if named else None)

    async def ModelInfer(self, request: pb.ModelInferRequest | Refused, context: _Context) -> Any:
        started = time.perf_counter()
        rid = _request_id(context)
        if isinstance(request, Refused):
            count_refused(request.model, request.error, started)
            await _abort(context, request.error, rid)
        call = _Call(request, context, rid)
        version = request.model_version or None
        return await infer(
            self._models, request.model_name, version, None, call, None, _infer, _GRPC
        )

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context: _Context) -> Any:
        return await _repository_call(context, self._repository.index, request)

    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: _Context
    ) -> Any:
        return await _repository_call(context, self._repository.load, request)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: _Context
    ) -> Any:
        return await _repository_call(context, self._repository.unload, request)

    async def _model(self, context: _Context, name: str, version: str) -> ModelHandle:
        """The model served as ``name`` at ``version`` (empty: the server's choice) for a look
        (readiness, metadata, config); else the call ends with NOT_FOUND naming the models or
        versions there are."""
        try:
            # Only an inference takes a turn of a canary's split (``ModelInfer``); a look does not.
            return self._models.model(name, version or None, split=False)
        except ShardServeError as exc:
            await _abort(context, exc, "-")


class _Call:
    """One ``ModelInfer`` call as the data plane hands it to gRPC's work and transport."""

    __slots__ = ("context", "message", "rid")

    def __init__(self, message: pb.ModelInferRequest, context: _Context, rid: str) -> None:
        self.message = message
        self.context = context
        self.rid = rid


class _Grpc:
    """gRPC's transport of the data plane (``dataplane.Transport``): the call's deadline, and
    its response or its status (``status_code``) with the request id in its trailing
    metadata."""

    __slots__ = ()

    def deadline(self, call: _Call, settings: Settings) -> float:
        return rpc_deadline(call.context.time_remaining(), settings.request_timeout_ms)

    async def answer(
        self, call: _Call, outcome: pb.ModelInferResponse | Failure
    ) -> pb.ModelInferResponse:
        if isinstance(outcome, Failure):
            if outcome.unexpected is not None:
                log.error(
                    "request %s: unexpected error in ModelInfer",
                    call.rid,
                    exc_info=outcome.unexpected,
                )
            await _abort(call.context, outcome.error, call.rid)
        call.context.set_trailing_metadata((("x-request-id", call.rid),))
        return outcome

    def request_id(self, call: _Call) -> str:
        return call.rid


_GRPC = _Grpc()


async def _infer(
    call: _Call, model: ModelHandle, batcher: Batcher, deadline: float
) -> pb.ModelInferResponse:
    """The work of one admitted call (the data plane's ``Work``): decode, submit, encode."""
    request, rid = call.message, call.rid
    timeout_s = request_timeout_s(request)
    if timeout_s is not None:
        deadline = min(deadline, time.monotonic() + timeout_s)
    signature = model.signature
    inputs = decode_inputs(request, signature, request_limits(model, batcher))
    check_sequence_length(inputs, model)
    names = requested_outputs(request, signature)
    outputs = await batcher.submit(inputs, deadline=deadline, request_id=rid)
    tensors, raw = encode_outputs(outputs, names, signature)
    return pb.ModelInferResponse(
        model_name=model.name,
        model_version=model.version,
        id=request.id,
        outputs=tensors,
        raw_output_contents=raw,
    )


async def _answer(
    context: _Context, body: Callable[[ModelHandle], dict[str, Any]], model: ModelHandle
) -> dict[str, Any]:
    """``body(model)``; a ``ShardServeError`` (the model is still loading) ends the call."""
    try:
        return body(model)
    except ShardServeError as exc:
        await _abort(context, exc, "-")


async def _repository_call(
    context: _Context,
    call: Callable[[_Request, Metadata], Awaitable[_Response]],
    request: _Request,
) -> _Response:
    """``call``'s answer; its refusal (or an unexpected error, logged) ends the call."""
    rid = _request_id(context)
    error: ShardServeError | None = None
    try:
        return await call(request, context.invocation_metadata() or ())
    except ShardServeError as exc:
        error = exc
    except Exception:
        log.exception("request %s: unexpected error in %s", rid, type(request).__name__)
    await _abort(context, error, rid)


def _request_id(context: _Context) -> str:
    metadata = context.invocation_metadata() or ()
    headers = [(k.encode(), v.encode()) for k, v in metadata if isinstance(v, str)]
    return request_id_from(headers).decode()


async def _abort(context: _Context, error: ShardServeError | None, rid: str) -> NoReturn:
    """End the call with the error's status (``None``: an unexpected error, INTERNAL, which its
    caller logged with its traceback and request id), and its retry hint where it has one
    (``RETRY_AFTER_KEY``)."""
    metadata = [("x-request-id", rid)]
    if error is None:
        code, message = grpc.StatusCode.INTERNAL, "internal server error; see the server log"
    else:
        code, message = status_code(error), error.message
        log_failure(rid, error.status_code, message)
        retry_after = retry_after_seconds(error)
        if retry_after is not None:
            metadata.append((RETRY_AFTER_KEY, str(retry_after)))
    await context.abort(code, message, trailing_metadata=tuple(metadata))
    raise AssertionError("context.abort returns only by raising")


async def start_grpc_server(
    models: ModelDirectory, settings: Settings, repository: RepositorySource = _no_repository
) -> grpc.aio.Server | None:
    """Serve gRPC on ``settings.grpc_port`` in the running event loop (``None`` when it is 0);
    ``repository`` gives the repository control the repository calls use, once there is one."""
    if not settings.grpc_port:
        return None
    server = grpc.aio.server(
        # One more call is refused at once (RESOURCE_EXHAUSTED), before its message is read.
        maximum_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
        options=[
            # The body cap of HTTP: a bigger message is refused before it is decoded.
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            # gRPC shares a busy port by default (SO_REUSEPORT): make it an error instead.
            ("grpc.so_reuseport", 0),
        ],
    )
    servicer = InferenceServicer(models, RepositoryRpcs(repository, settings.admin_token))
    generated = _Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, generated)  # type: ignore[arg-type]
    handlers = generated.handlers
    # ModelInfer's message is checked against its model's limits before it is parsed.
    handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer,
        request_deserializer=servicer.read_infer,
        response_serializer=pb.ModelInferResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(generated.service, handlers),)
    )
    server.add_registered_method_handlers(generated.service, handlers)
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
