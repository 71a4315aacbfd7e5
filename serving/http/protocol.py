"""shardserve's HTTP protocol for uvicorn (httptools): a deadline on each request's head, the cap
on open connections and queue-full refusals answered before any ASGI work, and a hang-up
reported to the request's handler without a watcher task.

**Slow heads.** uvicorn waits for a request's head for ever (its keep-alive timer stops at the
first byte and is armed only after an answer), so a connection that sends nothing, or its head
a byte at a time, would hold one of the ``max_connections`` for good: a head not complete within
``body_read_timeout_s`` of its first byte (of the connection's start, for the first) gets a 408
and the connection is closed; one timer watches every connection (``Deadlines``).

**The cap.** The sockets are counted, not the requests: a connection made while
``max_connections`` are open is answered a 503 with ``Retry-After`` at once, before it sends
anything, and closed (after ``_LINGER_S``, reading and dropping what it sends meanwhile), so that
a flood of idle or slow connections holds neither memory nor file descriptors beyond the cap
(uvicorn's ``limit_concurrency`` counts when a request's headers are complete: sockets that never
send one were bounded only by the head's timer and the fd limit). A request while as many
requests are in progress (a connection gone, its request still running) gets the same 503. The
count costs a connection two additions; a request, nothing more. Answered in the server's words
(a JSON error, not uvicorn's text) and without uvicorn's log line per refusal; uvicorn's own
protocol (without httptools) applies uvicorn's rule with the same cap (``serving.cli.serve``).

**Refusals.** Under overload most requests are refused (issue 10: 3x the capacity offered, two of
three get 503). Through the ASGI app each refusal still cost an ASGI task, a scope, a chain of
coroutines and two socket writes (py-spy: the writes alone were 30% of a refusal). Here the parser's
"headers complete" callback answers a POST to a fast route of the served model while the queue has
no room for one more row: one prebuilt response, one write, no task; the body that follows is
discarded by uvicorn as for any answered request. Everything else (a route the fast path does not
own, another model's name, a body over ``max_body_bytes``, a server still loading or stopping) goes
to the app as before, so its answer is unchanged. Whether to refuse, and the refusal's count, is the
data plane's (``FastRoutes.refuse_from_headers``, which the server sets to
``serving.protocols.rest.refuse_from_headers``): this writes its answer. Only where nothing would
wrap the answer: the app has no middleware of the user's (a CORS or auth layer sees every response)
and is not traced (``ShardServeApp.answers_fast_routes``).

**Hang-ups.** A request waiting on the batcher must learn that its client went away (its
rows are then dropped). Through ASGI alone that takes a task per request blocked in
``receive()``; here the scope of every request carries a list (``fast.DISCONNECT_KEY``)
where its handler puts a callback, called when the connection is lost before the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from serving.http.body_deadline import Deadlines
from serving.http.fast import DISCONNECT_KEY, FastRoutes
from serving.http.replies import request_id_from
from serving.telemetry import active
from serving.telemetry.headers import server_timing_of
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["http_protocol", "retry_later"]

log = logging.getLogger("shardserve")
_STATUS = b"HTTP/1.1 503 Service Unavailable\r\n"
_WARN_EVERY_S = 10.0  # one log line per this long at most, however many requests are refused
_LINGER_S = 0.5


def http_protocol(app: FastAPI) -> type[Any] | str:
    """uvicorn's httptools protocol for ``app``; ``"auto"`` (uvicorn's own) without httptools
    or for an app without fast routes (``ShardServeApp`` has them)."""
    if not isinstance(getattr(app, "fast_routes", None), FastRoutes):
        return "auto"
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # uvicorn without httptools: h11, refusals through the app
        return "auto"
    refuser = _Refuser(app)
    watches: list[Deadlines[Any]] = []  # the running loop's heads being waited for

    def heads(loop: asyncio.AbstractEventLoop) -> Deadlines[Any]:
        if not watches or watches[0].loop is not loop:
            watches[:] = [Deadlines(loop, lambda protocol: protocol.head_timed_out())]
        return watches[0]

    class ShardServeProtocol(HttpToolsProtocol):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.limit_concurrency = None  # the cap is applied below, in the server's words
            self.lingering = False
            self.counted = False  # one of the max_connections
            self._heads = heads(self.loop)  # a connection lives on one loop: looked up once

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            cap = refuser.max_connections()
            if cap is not None:
                if refuser.open_connections >= cap:
                    self._refuse_connection(cap)
                    return
                refuser.open_connections += 1
                self.counted = True
            self._wait_for_head()

        def _refuse_connection(self, cap: int) -> None:
            head = [_STATUS]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            answer = refuser.over_cap(self.client, request_id_from(()), "", "", cap)
            self.transport.write(b"".join([*head, b"connection: close\r\n", answer]))
            self._linger()  # the client may be sending its first request

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self not in self._heads:  # a connection's first head is timed from its start
                self._wait_for_head()

        def on_headers_complete(self) -> None:
            self._heads.end(self)
            super().on_headers_complete()

        def _wait_for_head(self) -> None:
            timeout_s = refuser.read_timeout_s()
            if timeout_s is not None:
                self._heads.start(self, timeout_s)

        def head_timed_out(self) -> None:
            """A request's head (or a connection's first byte) did not come within
            ``body_read_timeout_s``: uvicorn would wait for ever (its keep-alive timer stops
            at the first byte, and starts only after an answer), holding a connection of the
            ``max_connections`` that everyone shares."""
            if self.transport.is_closing():
                return
            cycle: Any = self.cycle
            if cycle is not None and not cycle.response_complete:
                self._wait_for_head()  # the next head of a pipeline: the answer first
                return
            head = [b"HTTP/1.1 408 Request Timeout\r\n"]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            self.transport.write(b"".join([*head, refuser.head_timeout_answer()]))
            refuser.log_refusal(self.client, "", 408, "head_timeout")
            self._linger()  # the client may still be sending its head

        def _start_asgi_task(self, cycle: Any, asgi: Any) -> None:
            cap = refuser.max_connections()
            answer: bytes | None
            if cap is not None and len(self.tasks) >= cap:
                cycle.keep_alive = False
                scope = cycle.scope
                answer = refuser.over_cap(
                    scope.get("client"), request_id_from(scope["headers"]), scope.get("path", ""),
                    f"{len(self.tasks)} requests in progress", cap,
                )  # fmt: skip
            else:
                answer = refuser.answer(cycle.scope)
            if answer is None:
                cycle.scope[DISCONNECT_KEY] = []
                cycle.transport = _CycleTransport(self, cycle)
                super()._start_asgi_task(cycle, asgi)
                return
            head = [_STATUS]
            for name, value in self.server_state.default_headers:
                head += [name, b": ", value, b"\r\n"]
            if not cycle.keep_alive:
                head.append(b"connection: close\r\n")
            self.transport.write(b"".join([*head, answer]))
            cycle.response_started = cycle.response_complete = True
            if not cycle.keep_alive:
                self.close_after_answer(cycle)
            cycle.message_event.set()
            cycle.on_response()

        def close_after_answer(self, cycle: Any) -> None:
            """Close the connection once ``cycle``'s answer is out. While the client may still
            be sending the request's body (a 408 for a slow body, a refusal from the headers),
            closing at once would answer its next bytes with a TCP reset, on which the
            client's system can drop the answer unread: the answer is then followed by a FIN,
            and what the client still sends is read and dropped for ``_LINGER_S`` (as Go's
            net/http does), after which the connection closes whatever the client does."""
            if not cycle.more_body or self.transport.is_closing():
                self.transport.close()
                return
            self._linger()

        def _linger(self) -> None:
            self.lingering = True
            if self.transport.can_write_eof():  # not over TLS: the close alone ends it there
                self.transport.write_eof()
            self.flow.resume_reading()
            self.loop.call_later(_LINGER_S, self.transport.close)

        def data_received(self, data: bytes) -> None:
            if not self.lingering:
                super().data_received(data)

        def on_response_complete(self) -> None:
            if self.lingering:  # no next request on this connection
                self.server_state.total_requests += 1
                return
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            if self.counted:
                self.counted = False
                refuser.open_connections -= 1
            self._heads.end(self)
            cycle: Any = self.cycle
            super().connection_lost(exc)
            if cycle is not None and not cycle.response_complete:
                hooks: list[Callable[[], None]] = cycle.scope.get(DISCONNECT_KEY) or []
                for hung_up in hooks:
                    hung_up()
            # The connection and its last request's cycle hold each other (``cycle.on_response``,
            # its transport): let go, so that reference counting frees them, as uvicorn lets go
            # of the parser. Left to the collector, a churn of connections (a client past
            # max_connections reconnects at once) piled up between collections: at 3x overload
            # the front end's RSS grew for as long as the load lasted.
            self.cycle = None  # type: ignore[assignment]  # as uvicorn drops its parser
            self.pipeline.clear()

    return ShardServeProtocol


class _CycleTransport:
    """The connection as a request's ASGI cycle sees it: uvicorn's transport, whose close waits
    for the client to stop sending (``ShardServeProtocol.close_after_answer``).

    It holds its cycle weakly: the cycle holds it (``cycle.transport``), and a strong reference
    back made every request's cycle, scope and headers garbage that only the collector frees,
    not reference counting: ~24 objects a request, 7-12 us of collections, and under load they
    piled up between collections (issue 37: the front end's RSS at 3x overload)."""

    __slots__ = ("_cycle", "_protocol", "is_closing", "write")

    def __init__(self, protocol: Any, cycle: Any) -> None:
        transport = protocol.transport
        self.write = transport.write
        self.is_closing = transport.is_closing
        self._protocol = protocol
        self._cycle = weakref.ref(cycle)

    def close(self) -> None:
        cycle = self._cycle()  # alive: it is the one closing
        if cycle is None:
            self._protocol.transport.close()
        else:
            self._protocol.close_after_answer(cycle)


class _Refuser:
    def __init__(self, app: Any) -> None:  # a ShardServeApp: fast_routes, answers_fast_routes
        self.app = app
        self._cap: int | None = None
        self.open_connections = 0  # those counted against the cap (the refused are not)
        self._read_timeout_s: float | None = None
        self._over_cap = 0  # refused since the last log line
        self._warn_at = 0.0

    def _settings(self) -> Any:
        """The server's settings (``None`` before its lifespan made its state): the server's state
        (serving.server.state), which the directory protocol of the routes does not name."""
        return getattr(getattr(self.app.state, "shardserve", None), "settings", None)

    def read_timeout_s(self) -> float | None:
        """The server's ``body_read_timeout_s`` (``None`` before its lifespan made its state)."""
        if self._read_timeout_s is None and (settings := self._settings()) is not None:
            self._read_timeout_s = settings.body_read_timeout_s
        return self._read_timeout_s

    def head_timeout_answer(self) -> bytes:
        """The headers (after the status line) and body of a 408 for a head that did not
        come in time."""
        body = orjson.dumps(
            {
                "error": f"the request head did not arrive within body_read_timeout_s="
                f"{self._read_timeout_s:g} s; send it whole, or raise body_read_timeout_s"
            }
        )
        return b"".join(
            [
                b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
                b"server-timing: ",
                server_timing_of(0.0),
                b"\r\nconnection: close\r\n\r\n",
                body,
            ]
        )

    def max_connections(self) -> int | None:
        """The server's ``max_connections`` (``None`` before its lifespan made its state)."""
        if self._cap is None and (settings := self._settings()) is not None:
            self._cap = settings.max_connections
        return self._cap

    def log_refusal(self, client: Any, rid: str, status: int, reject: str, route: str = "") -> None:
        """The access-log line of a connection's refusal here (no model: past the cap, a head
        too slow), where the log is on; a model's refusal is the data plane's
        (``FastRoutes.refuse_from_headers``)."""
        access = active.access_log
        if access is None:
            return
        stamp = Stamp(time.perf_counter())
        stamp.status = status
        access.line(
            stamp, request_id=rid, client=f"{client[0]}:{client[1]}" if client else "-",
            route=route, protocol="http", reject=reject, total_ms=0.0,
        )  # fmt: skip

    def over_cap(self, client: Any, rid: bytes, path: str, held: str, cap: int) -> bytes:
        """A 503 for a connection (``path`` empty) or a request past the cap (the headers after
        the status line, and the body); ``held``: what is open, in words (a connection's: the
        open connections, itself included)."""
        held = held or f"{self.open_connections + 1} open"
        self.log_refusal(client, rid.decode(), 503, "max_connections", path)
        body = orjson.dumps(
            {"error": f"too many open connections: {held}, max_connections={cap}; retry later"}
        )
        self._over_cap += 1
        now = time.monotonic()
        if now >= self._warn_at:
            log.warning(
                "%d connection(s) or request(s) refused with 503: %s, max_connections=%d",
                self._over_cap,
                held,
                cap,
            )
            self._over_cap, self._warn_at = 0, now + _WARN_EVERY_S
        return retry_later(rid, body, 0.0)

    def answer(self, scope: dict[str, Any]) -> bytes | None:
        """The headers and body of a 503 after the status line, or None to let the app
        answer."""
        started = time.perf_counter()
        if scope["method"] != "POST":
            return None
        models = getattr(self.app.state, "shardserve", None)
        refuse = self.app.fast_routes.refuse_from_headers
        if models is None or refuse is None or not self.app.answers_fast_routes:
            return None
        hit = self.app.fast_routes.match_scope(scope)
        if hit is None:
            return None
        refusal = refuse(models, hit[1], scope, started)
        if refusal is None:
            return None
        rid, body, total_ms = refusal
        if log.isEnabledFor(logging.DEBUG):
            log.debug("request %s: 503 queue full (refused from its headers)", rid.decode())
        return retry_later(rid, body, total_ms)


def retry_later(rid: bytes, body: bytes, total_ms: float) -> bytes:
    """The headers (after the status line) and JSON body of a 503 with ``Retry-After: 1``."""
    return b"".join(
        [
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body),
            b"retry-after: 1\r\nserver-timing: ",
            server_timing_of(total_ms),
            b"\r\nx-request-id: ",
            rid,
            b"\r\n\r\n",
            body,
        ]
    )
