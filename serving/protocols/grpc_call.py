"""What every gRPC service on the port shares for one call: its status for each refusal, its
deadline, its request id, and the data plane's gRPC transport (``GrpcTransport``).

V2's ``inference.GRPCInferenceService`` and TF Serving's ``tensorflow.serving`` services end a
call the same way, written once here (KServe's ``protocol/grpc`` is one module for the same
reason): the error's status from one table, a one-line reason, the request id (and, where a
retry helps, ``retry-after``) in the trailing metadata.

    InvalidInputError, ModelInputError    INVALID_ARGUMENT
    UnauthorizedError                     UNAUTHENTICATED
    ForbiddenError                        PERMISSION_DENIED
    NotFoundError                         NOT_FOUND
    QueueFullError, NotReadyError         UNAVAILABLE (with ``retry-after``)
    DeadlineExceededError                 DEADLINE_EXCEEDED
    PayloadTooLargeError                  RESOURCE_EXHAUSTED
    BatchFailedError, anything else       INTERNAL
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NoReturn, TypeAlias, TypeVar

import grpc
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
from serving.http.replies import log_failure, request_id_from, retry_after_seconds
from serving.protocols.dataplane import Failure
from serving.protocols.dataplane import refused as count_refused
from serving.telemetry import active
from serving.telemetry.headers import server_timing_of
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from serving.protocols.contract import ModelHandle
    from serving.settings.config import Settings

__all__ = [
    "RETRY_AFTER_KEY",
    "SERVER_TIMING_KEY",
    "SMALL_MESSAGE",
    "Context",
    "GrpcCall",
    "GrpcTransport",
    "Handlers",
    "Refused",
    "abort",
    "refuse",
    "request_id",
    "rpc_deadline",
    "status_code",
]

log = logging.getLogger("shardserve")
SMALL_MESSAGE = 64 * 1024  # the most a call's message may be, but an inference's
RETRY_AFTER_KEY = "retry-after"
SERVER_TIMING_KEY = "server-timing"
Context: TypeAlias = grpc.aio.ServicerContext
M = TypeVar("M")  # a call's request message

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


@dataclass(frozen=True)
class Refused:
    """What a call's handler gets instead of a message refused before it was parsed (a
    deserializer that raised would end the call UNKNOWN, not with the refusal's status)."""

    error: ShardServeError
    model: ModelHandle | None  # the model it named, where there is one


class Handlers:
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

    def bound_small(self, *, skip: Collection[str] = ()) -> None:
        """Every unary call but those in ``skip`` refuses a message over ``SMALL_MESSAGE``
        bytes (INVALID_ARGUMENT) before protobuf parses it: a look (metadata, status, ready)
        or a call this server does not serve names a model and what to ask of it, and a
        16 MiB one of repeated strings cost 244 MiB and 0.45 s of the event loop to parse."""
        for name, handler in list(self.handlers.items()):
            if name in skip or handler.unary_unary is None:
                continue
            self.handlers[name] = grpc.unary_unary_rpc_method_handler(
                _refusing(handler.unary_unary),
                request_deserializer=_read_small(name, handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )

    def install(self, server: grpc.aio.Server) -> str:
        """Serve the handlers on ``server``; the service's full name."""
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(self.service, self.handlers),)
        )
        server.add_registered_method_handlers(self.service, self.handlers)
        return self.service


def _read_small(method: str, parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def read(data: bytes) -> Any:
        if len(data) > SMALL_MESSAGE:
            return Refused(
                InvalidInputError(
                    f"the {method} message is {len(data):,} bytes; it is at most "
                    f"{SMALL_MESSAGE:,} (a model's name and what to ask of it)"
                ),
                None,
            )
        try:
            return data if parse is None else parse(data)
        except DecodeError:  # a string that is not UTF-8: gRPC would say UNKNOWN
            return Refused(InvalidInputError(f"the {method} message is not a valid one"), None)

    return read


def _refusing(behavior: Callable[[Any, Context], Awaitable[Any]]) -> Callable[..., Any]:
    async def call(request: Any, context: Context) -> Any:
        if isinstance(request, Refused):
            await abort(context, request.error, request_id(context))
        return await behavior(request, context)

    return call


class GrpcCall(Generic[M]):
    """One inference call as the data plane hands it to a protocol's work and the transport."""

    __slots__ = ("context", "message", "rid")

    def __init__(self, message: M, context: Context, rid: str) -> None:
        self.message = message
        self.context = context
        self.rid = rid


class GrpcTransport:
    """gRPC's transport of the data plane (``dataplane.Transport``): the call's deadline, and
    its response or its status (``status_code``) with the request id in its trailing
    metadata. ``method``: the call's name, for the log of an unexpected error."""

    __slots__ = ("method",)

    def __init__(self, method: str) -> None:
        self.method = method

    def deadline(self, call: GrpcCall[Any], settings: Settings) -> float:
        return rpc_deadline(call.context.time_remaining(), settings.request_timeout_ms)

    async def answer(self, call: GrpcCall[Any], outcome: Any, stamp: Stamp) -> Any:
        timing = (SERVER_TIMING_KEY, stamp.server_timing())
        if isinstance(outcome, Failure):
            if outcome.unexpected is not None:
                log.error(
                    "request %s: unexpected error in %s",
                    call.rid,
                    self.method,
                    exc_info=outcome.unexpected,
                )
            await abort(call.context, outcome.error, call.rid, (timing,))
        if active.access_log is not None:
            stamp.bytes_out = outcome.ByteSize()
        call.context.set_trailing_metadata((("x-request-id", call.rid), timing))
        return outcome

    def request_id(self, call: GrpcCall[Any]) -> str:
        return call.rid

    def trace_context(self, call: GrpcCall[Any]) -> tuple[str | None, str | None]:
        parent = state = None
        for key, value in call.context.invocation_metadata() or ():
            if key == "traceparent" and parent is None and isinstance(value, str):
                parent = value
            elif key == "tracestate" and state is None and isinstance(value, str):
                state = value
        return parent, state

    def describe(self, call: GrpcCall[Any]) -> tuple[str, str, str, int]:
        size = getattr(call.message, "ByteSize", None)
        return self.method, "grpc", call.context.peer() or "-", size() if size else 0


async def refuse(
    context: Context, refused: Refused, rid: str, started: float, method: str
) -> NoReturn:
    """End a call refused before its message was parsed (``Refused``) as ``abort`` does, with
    its ``server-timing``, counted by the data plane (``dataplane.refused``: the model's
    metrics, the access log)."""
    total_ms = count_refused(
        refused.model, refused.error, started,
        request_id=rid, client=context.peer() or "-", route=method, protocol="grpc",
    )  # fmt: skip
    timing = server_timing_of(total_ms).decode()
    await abort(context, refused.error, rid, ((SERVER_TIMING_KEY, timing),))


def request_id(context: Context) -> str:
    """The call's ``x-request-id`` (its metadata's, else a new one)."""
    metadata = context.invocation_metadata() or ()
    headers = [(k.encode(), v.encode()) for k, v in metadata if isinstance(v, str)]
    return request_id_from(headers).decode()


async def abort(
    context: Context,
    error: ShardServeError | None,
    rid: str,
    extra: Sequence[tuple[str, str]] = (),
) -> NoReturn:
    """End the call with the error's status (``None``: an unexpected error, INTERNAL, which its
    caller logged with its traceback and request id), and its retry hint where it has one
    (``RETRY_AFTER_KEY``); ``extra``: more trailing metadata (``server-timing``)."""
    metadata = [("x-request-id", rid), *extra]
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
