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
from serving.http.replies import Reply, error_reply, send_reply, unexpected_reply
from serving.protocols.contract import ModelDirectory
from serving.protocols.dataplane import Failure, GenerateWork, Work, generate, infer
from serving.protocols.streaming import STREAMED, STREAMED_KEY
from serving.telemetry.headers import SERVER_TIMING, client_address, trace_headers
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = [
    "HttpGenerateWork",
    "HttpWork",
    "RestTransport",
    "serve_generation",
    "serve_prediction",
]

# A protocol's work over HTTP: (request, model, its batcher, deadline) -> the reply
HttpWork = Work[FastRequest, Reply]
# A generate request's work over HTTP: (request, model, its generator, deadline) -> the reply
HttpGenerateWork = GenerateWork[FastRequest, Reply]


class RestTransport:
    """The HTTP transport of the data plane (``dataplane.Transport``)."""

    __slots__ = ()

    def deadline(self, request: FastRequest, settings: Settings) -> float:
        return request_deadline(request.timeout_ms, settings)

    def answer(
        self, request: FastRequest, outcome: Reply | Failure, stamp: Stamp
    ) -> Awaitable[None]:
        # Returns ``send_reply``'s coroutine rather than awaiting it: no frame of its own.
        if isinstance(outcome, Failure):
            if request.scope.get(STREAMED_KEY):  # a stream's answer has started: no other
                if outcome.unexpected is not None:
                    unexpected_reply(request.scope, outcome.unexpected)  # its log line
                return _nothing()
            outcome = self.failure_reply(request, outcome)
        elif outcome is STREAMED:  # a stream's work sent its answer itself
            return _nothing()
        status, body, content_type, headers = outcome
        stamp.bytes_out = len(body)
        timing = (SERVER_TIMING, stamp.server_timing().encode())
        headers = [*headers, timing] if headers else [timing]
        return send_reply(request.send, request.rid, status, body, content_type, headers)

    def failure_reply(self, request: FastRequest, failure: Failure) -> Reply:
        """A failure's answer (a protocol with errors of its own shape overrides it)."""
        if failure.error is not None:
            return error_reply(failure.error, request.rid)
        if failure.unexpected is not None:
            return unexpected_reply(request.scope, failure.unexpected)
        return (499, b"", b"text/plain", [])  # the client went away: nobody reads it

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


_REST = RestTransport()


async def _nothing() -> None:
    return None


def serve_prediction(
    request: FastRequest, models: ModelDirectory, ref: ModelRef, work: HttpWork
) -> Coroutine[Any, Any, None]:
    """Answer one predict-like request for the model (version, or label) ``ref`` names with
    ``work``: the data plane's coroutine itself, so that the route awaits no frame more."""
    return infer(
        models, ref.name, ref.version, ref.label, request, request.content_length, work, _REST
    )


def serve_generation(
    request: FastRequest, models: ModelDirectory, ref: ModelRef, work: HttpGenerateWork
) -> Coroutine[Any, Any, None]:
    """Answer one generate request for the model ``ref`` names with ``work`` (handed the
    version's generator): the data plane's coroutine itself."""
    return generate(
        models, ref.name, ref.version, ref.label, request, request.content_length, work, _REST
    )
