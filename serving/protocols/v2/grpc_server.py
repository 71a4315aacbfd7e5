"""The Open Inference Protocol (KServe V2) over gRPC: ``inference.GRPCInferenceService``.

Served by ``grpc.aio`` in the HTTP server's process and event loop, beside TF Serving's services
on the same port (the server is ``serving.protocols.grpc_port``'s), on the same batcher,
admission, tensor checks and metrics as ``/v2/.../infer``; messages to arrays and back in
``grpc_codec``. A call's ``model_version`` (``version``) picks the version of the model it names;
empty, the server's choice (its highest ready version). The model repository's calls (index,
load, unload) are in ``grpc_repository``. Errors are the call's status
(``serving.protocols.grpc_call``'s table: NOT_FOUND, UNAVAILABLE, ...), and besides:

    a message over max_body_bytes         RESOURCE_EXHAUSTED (refused by gRPC before decoding)
    more inputs or values than fit        INVALID_ARGUMENT (before it is parsed: ``grpc_bounds``)
    bytes that are no ModelInferRequest   INVALID_ARGUMENT (gRPC's own answer was UNKNOWN)
    a call past grpc_max_concurrent_rpcs  RESOURCE_EXHAUSTED (refused by gRPC before reading it)

Every call's trailing metadata carries its ``x-request-id``; a refusal with a retry hint (a full
queue, no healthy replica now) carries ``retry-after`` too, whole seconds as a string: HTTP's
``Retry-After`` header, the same value. ``ModelInfer`` is the data plane's
(``serving.protocols.dataplane.infer``: look-up, admission, deadline, the admission held across
decode and submit, the same rejects, latency and canary metrics as HTTP's), with gRPC's
transport (``grpc_call.GrpcTransport``): the call's deadline, and its answer or status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from serving.errors import InvalidInputError, ShardServeError
from serving.protocols.contract import ModelDirectory, ModelHandle
from serving.protocols.dataplane import infer, submit
from serving.protocols.grpc_call import (
    Context,
    GrpcCall,
    GrpcTransport,
    Handlers,
    Refused,
    abort,
    refuse,
    request_id,
    rpc_deadline,
)
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

__all__ = ["InferenceServicer", "add_v2_service", "rpc_deadline"]

log = logging.getLogger("shardserve")
_Context = Context
_Request = TypeVar("_Request")
_Response = TypeVar("_Response")
_Call = GrpcCall[pb.ModelInferRequest]
_GRPC = GrpcTransport("ModelInfer")
_abort = abort
_request_id = request_id


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, models: ModelDirectory, repository: RepositoryRpcs) -> None:
        self._models = models
        self._repository = repository

    async def ServerLive(self, request: pb.ServerLiveRequest, context: _Context) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: _Context) -> Any:
        return pb.ServerReadyResponse(ready=self._models.available)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: _Context) -> Any:
        return json_format.ParseDict(server_metadata(), pb.ServerMetadataResponse())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: _Context) -> Any:
        model = await self._model(context, request.name, request.version)
        return pb.ModelReadyResponse(ready=model.available)

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
            await refuse(context, request, rid, started, "ModelInfer")
        call: _Call = GrpcCall(request, context, rid)
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


async def _infer(
    call: _Call, model: ModelHandle, batcher: Batcher, deadline: float
) -> pb.ModelInferResponse:
    """The work of one admitted call (the data plane's ``Work``): decode, submit, encode."""
    request, rid = call.message, call.rid
    timeout_s, since = request_timeout_s(request), time.monotonic()  # counted from here
    signature = model.signature
    inputs = decode_inputs(request, signature, request_limits(model, batcher))
    names = requested_outputs(request, signature)
    outputs = await submit(inputs, model, batcher, deadline, rid, timeout_s, since)
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


def add_v2_service(
    server: grpc.aio.Server,
    models: ModelDirectory,
    settings: Settings,
    repository: RepositorySource,
) -> str:
    """Serve ``inference.GRPCInferenceService`` on ``server``; its full name. ``repository``
    gives the repository control the repository calls use, once there is one."""
    servicer = InferenceServicer(models, RepositoryRpcs(repository, settings.admin_token))
    generated = Handlers()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, generated)  # type: ignore[arg-type]
    generated.bound_small(skip={"ModelInfer"})  # a look or a repository call is small
    # ModelInfer's message is checked against its model's limits before it is parsed.
    generated.handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer,
        request_deserializer=servicer.read_infer,
        response_serializer=pb.ModelInferResponse.SerializeToString,
    )
    return generated.install(server)
