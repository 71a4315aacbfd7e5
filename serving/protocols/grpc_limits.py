"""What a gRPC call may hold, and for how long: the gRPC port's side of the HTTP protocol's
timers and caps (``serving.http.protocol``).

grpc's own ``maximum_concurrent_rpcs`` counts a call from its first frame to its end, whatever it
waits for: 256 ``Health.Watch`` streams (which never end), or 256 calls that never send their
message, took every slot, and every other call got RESOURCE_EXHAUSTED (issue 37, item 8). Here
a call is counted by what it holds:

    waiting for its message     at most ``body_read_timeout_s``, then DEADLINE_EXCEEDED
    served (message in hand)    at most ``grpc_max_concurrent_rpcs`` at once
    a stream (Health.Watch,     at most ``grpc_max_streams`` at once, apart from the calls
      server reflection)        served
    all of them                 at most ``grpc_max_open_calls`` (grpc's own cap, refused
                                before anything is read)

One past a cap gets RESOURCE_EXHAUSTED at once. A unary method is served here as a
client-streaming one (the same frames on the wire): grpc then starts the handler at the call's
first frame instead of once the message came, so that the read can be timed and the call counted
as served only from then on. A served call whose cap is full is refused before its message is
read (and parsed), and again once it is read.

The connection's own limits (keepalive, idle and age) are grpc's channel options
(``server_options``).

The calls that take the admin token (``admin_methods``) are refused (PERMISSION_DENIED) before
their message is read where the token would come in clear text over a network: a port without
TLS and a peer other than the loopback address, unless ``--allow-plaintext-admin``
(``serving.http.admin_token.check_admin_transport``, HTTP's rule).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias
from urllib.parse import unquote

import grpc

from serving.batching.dispatch import SHUTTING_DOWN
from serving.errors import ForbiddenError
from serving.http.admin_token import Transport, check_admin_transport
from serving.http.body_deadline import body_deadlines

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = ["CallLimits", "peer_host", "server_options"]

_Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
_KEEPALIVE_MS = 60_000  # a ping after a minute without frames: a dead peer's streams end
_KEEPALIVE_TIMEOUT_MS = 20_000
_RETRY_LATER = (("retry-after", "1"),)


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """grpc's channel options for the connections' limits."""
    options = [
        ("grpc.keepalive_time_ms", _KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS),
        # Keep pinging a connection whose only call is a quiet stream (a Watch whose status
        # does not change): grpc stops after 2 pings without data by default.
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_connection_idle_ms", _ms(settings.grpc_max_connection_idle_s)),
    ]
    if settings.grpc_max_connection_age_s is not None:
        options += [
            ("grpc.max_connection_age_ms", _ms(settings.grpc_max_connection_age_s)),
            # The calls in progress at the GOAWAY get their deadline's time; then the
            # connection closes, streams included (grpc's default grace is for ever).
            ("grpc.max_connection_age_grace_ms", _ms(settings.request_timeout_ms / 1000.0)),
        ]
    return options


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000.0))


class CallLimits(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Counts and caps the calls of one gRPC server (see the module's docstring)."""

    def __init__(
        self, settings: Settings, admin_methods: frozenset[str] = frozenset(), admin_what: str = ""
    ) -> None:
        self.settings = settings
        self.admin_methods = admin_methods
        self.admin_what = admin_what
        self.max_served = settings.grpc_max_concurrent_rpcs
        self.max_streams = settings.grpc_max_streams
        self.read_timeout_s = settings.body_read_timeout_s
        self.waiting = 0  # calls whose message has not come yet
        self.served = 0
        self.streams = 0
        # Per method, the handler as served here; only methods the server has (a name is the
        # client's to choose).
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = self._handlers.get(details.method)
        if handler is None:
            found = await continuation(details)
            if found is None:
                return None
            handler = self._handlers[details.method] = self._wrap(found, details.method)
        return handler

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kinds = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            behavior = self._unary(handler.unary_unary, admin=method in self.admin_methods)
            return grpc.stream_unary_rpc_method_handler(behavior, *kinds)
        if handler.unary_stream is not None:
            behavior = self._unary_stream(handler.unary_stream)
            return grpc.stream_stream_rpc_method_handler(behavior, *kinds)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._stream(handler.stream_unary), *kinds)
        behavior = self._stream_stream(handler.stream_stream)
        return grpc.stream_stream_rpc_method_handler(behavior, *kinds)

    def _unary(self, inner: Callable[[Any, _Context], Awaitable[Any]], *, admin: bool) -> Any:
        async def served(_: AsyncIterator[Any], context: _Context) -> Any:
            if admin:
                await self._check_admin_transport(context)
            if self.served >= self.max_served:
                await _refuse(context, self._served_full())
            request = await self._read(context)
            if self.served >= self.max_served:
                await _refuse(context, self._served_full())
            self.served += 1
            try:
                return await inner(request, context)
            finally:
                self.served -= 1

        return served

    def _unary_stream(self, inner: Callable[[Any, _Context], Any]) -> Any:
        async def stream(_: AsyncIterator[Any], context: _Context) -> AsyncIterator[Any]:
            if self.streams >= self.max_streams:
                await _refuse(context, self._streams_full())
            self.streams += 1
            try:
                request = await self._read(context)
                responses = inner(request, context)
                if inspect.isasyncgen(responses):
                    async for response in responses:
                        yield response
                else:  # a handler that writes through the context
                    await responses
            finally:
                self.streams -= 1

        return stream

    def _stream(self, inner: Callable[[AsyncIterator[Any], _Context], Awaitable[Any]]) -> Any:
        async def stream(requests: AsyncIterator[Any], context: _Context) -> Any:
            if self.streams >= self.max_streams:
                await _refuse(context, self._streams_full())
            self.streams += 1
            try:
                return await inner(requests, context)
            finally:
                self.streams -= 1

        return stream

    def _stream_stream(self, inner: Callable[[AsyncIterator[Any], _Context], Any]) -> Any:
        async def stream(requests: AsyncIterator[Any], context: _Context) -> AsyncIterator[Any]:
            if self.streams >= self.max_streams:
                await _refuse(context, self._streams_full())
            self.streams += 1
            try:
                responses = inner(requests, context)
                if inspect.isasyncgen(responses):
                    async for response in responses:
                        yield response
                else:
                    await responses
            finally:
                self.streams -= 1

        return stream

    async def _read(self, context: _Context) -> Any:
        """The call's one message, or the call ended: one that does not come within
        ``body_read_timeout_s`` would hold its place for ever (a client need not set a
        deadline). Timed as HTTP's bodies are, by the loop's one timer (``body_deadlines``:
        an ``asyncio.timeout`` per call cost 9% of a light call's throughput), which a stop's
        drain also cuts."""
        task: asyncio.Task[Any] = asyncio.current_task()  # type: ignore[assignment]
        deadlines = body_deadlines()
        deadlines.start(task, self.read_timeout_s)
        self.waiting += 1
        try:
            request = await context.read()
        except asyncio.CancelledError:
            if deadlines.expired(task):
                task.uncancel()
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the request message did not arrive within body_read_timeout_s="
                    f"{self.read_timeout_s:g} s; send it with the call, or raise "
                    "body_read_timeout_s",
                )
            if deadlines.cut(task):
                task.uncancel()
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{SHUTTING_DOWN}: the request message had not arrived at the end of its "
                    "drain; send the call again",
                )
            raise
        finally:
            deadlines.end(task)
            self.waiting -= 1
        if request is grpc.aio.EOF:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message"
            )
        return request

    async def _check_admin_transport(self, context: _Context) -> None:
        settings = self.settings
        transport = Transport(settings.tls, peer_host(context.peer()))
        try:
            check_admin_transport(
                settings.admin_token, transport, settings.allow_plaintext_admin, self.admin_what
            )
        except ForbiddenError as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))

    def _served_full(self) -> str:
        return (
            f"too many gRPC calls in progress: {self.served}, grpc_max_concurrent_rpcs="
            f"{self.max_served}; retry later"
        )

    def _streams_full(self) -> str:
        return (
            f"too many gRPC streams open: {self.streams} (Health.Watch, reflection), "
            f"grpc_max_streams={self.max_streams}; close one, or retry later"
        )


def peer_host(peer: str) -> str | None:
    """The address in gRPC's peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, the
    brackets percent-encoded by some versions); ``None`` for another kind (``unix:``)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    return rest.rpartition(":")[0].strip("[]") or None


async def _refuse(context: _Context, message: str) -> NoReturn:
    """RESOURCE_EXHAUSTED with the retry hint a refusal over HTTP has (``Retry-After``)."""
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message, _RETRY_LATER)
    raise AssertionError("unreachable: abort raises")  # pragma: no cover
