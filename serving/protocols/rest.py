"""The data plane over HTTP: what TF Serving's REST predict (``/predict``, ``:predict``) and V2's
HTTP infer share around ``serving.protocols.dataplane.infer``. Each protocol brings only its
``work`` (read the body, decode, submit, encode); this brings the transport: the deadline from
``X-Request-Timeout-Ms``, and the answer sent as two ASGI messages with its ``X-Request-Id``,
a ``Failure`` as its status and ``{"error": message}`` (``serving.http.replies``).

It sits in ``serving.protocols``, not ``serving.http``: it calls the data plane, a layer above
``serving.http`` (which keeps the ASGI plumbing it uses: the fast request, admission from the
headers, the replies).
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any

from serving.http.admission import declared_length, request_deadline
from serving.http.fast import FastRequest, ModelRef
from serving.http.model import ModelDirectory
from serving.http.replies import Reply, error_reply, send_reply, unexpected_reply
from serving.protocols.dataplane import Failure, Work, infer
from serving.telemetry.headers import SERVER_TIMING, client_address, trace_headers
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = ["HttpWork", "serve_prediction"]

# A protocol's work over HTTP: (request, model, its batcher, deadline) -> the reply
HttpWork = Work[FastRequest, Reply]


class _Rest:
    """The HTTP transport of the data plane (``dataplane.Transport``)."""

    __slots__ = ()

    def deadline(self, request: FastRequest, settings: Settings) -> float:
        return request_deadline(request.timeout_ms, settings)

    def answer(
        self, request: FastRequest, outcome: Reply | Failure, stamp: Stamp
    ) -> Awaitable[None]:
        # Returns ``send_reply``'s coroutine rather than awaiting it: no frame of its own.
        if isinstance(outcome, Failure):
            if outcome.error is not None:
                outcome = error_reply(outcome.error, request.rid)
            elif outcome.unexpected is not None:
                outcome = unexpected_reply(request.scope, outcome.unexpected)
            else:  # the client went away: nobody reads it
                outcome = (499, b"", b"text/plain", [])
        status, body, content_type, headers = outcome
        stamp.bytes_out = len(body)
        timing = (SERVER_TIMING, stamp.server_timing().encode())
        headers = [*headers, timing] if headers else [timing]
        return send_reply(request.send, request.rid, status, body, content_type, headers)

    def request_id(self, request: FastRequest) -> str:
        return request.request_id

    def trace_context(self, request: FastRequest) -> tuple[str | None, str | None]:
        return trace_headers(request.scope["headers"])

    def describe(self, request: FastRequest) -> tuple[str, str, str, int]:
        length = request.content_length
        return (
            request.scope.get("path", ""),
            "http",
            client_address(request.scope),
            max(declared_length(length) or 0, 0),
        )


_REST = _Rest()


def serve_prediction(
    request: FastRequest, models: ModelDirectory, ref: ModelRef, work: HttpWork
) -> Coroutine[Any, Any, None]:
    """Answer one predict-like request for the model (version, or label) ``ref`` names with
    ``work``: the data plane's coroutine itself, so that the route awaits no frame more."""
    return infer(
        models, ref.name, ref.version, ref.label, request, request.content_length, work, _REST
    )
