"""The data plane over HTTP: what TF Serving's REST predict (``/predict``, ``:predict``) and V2's
HTTP infer share around ``serving.protocols.dataplane.infer``. Each protocol brings only its
``work`` (read the body, decode, submit, encode); this brings the transport: the deadline from
``X-Request-Timeout-Ms``, and the answer sent as two ASGI messages with its ``X-Request-Id``,
a ``Failure`` as its status and ``{"error": message}`` (``serving.http.replies``). And the
refusal from the headers that uvicorn's protocol answers before any ASGI work
(``refuse_from_headers``: a full queue), counted as the data plane counts a refusal.

It sits in ``serving.protocols``, not ``serving.http``: it calls the data plane, a layer above
``serving.http`` (which keeps the ASGI plumbing it uses: the fast request, admission from the
headers, the replies).
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Scope

from serving.errors import QueueFullError, ShardServeError
from serving.http.admission import declared_length, queue_full_message, request_deadline
from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import Reply, error_reply, request_id_from, send_reply, unexpected_reply
from serving.protocols.contract import ModelDirectory
from serving.protocols.dataplane import Failure, GenerateWork, Work, generate, infer, refused
from serving.protocols.streaming import STREAMED, STREAMED_KEY
from serving.telemetry.headers import SERVER_TIMING, client_address, trace_headers
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = [
    "HttpGenerateWork",
    "HttpWork",
    "RestTransport",
    "refuse_from_headers",
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


def refuse_from_headers(
    models: ModelDirectory, ref: ModelRef, scope: Scope, started: float
) -> tuple[bytes, bytes, float] | None:
    """A POST to a fast route (``ref``: its model) refused from its headers alone while its
    model's queue has no room for one more row: (its request id, the 503's JSON body, its total
    ms), counted as the data plane counts a refusal (``dataplane.refused``); ``None`` for
    anything else (another model's name, a server still loading or stopping, a body over
    ``max_body_bytes``), which the app answers as before. ``FastRoutes.refuse_from_headers``:
    uvicorn's protocol (``serving.http.protocol``) writes the answer."""
    try:
        # No turn of a canary's split: the app's own look up takes the request's.
        model = models.model(ref.name, ref.version, ref.label, split=False)
    except ShardServeError:  # another model's name: the app says which are served
        return None
    batcher = model.batcher
    if batcher is None:
        return None
    queued, limit = batcher.queued_rows, batcher.settings.max_queue_rows
    if queued < limit:
        return None
    try:
        model.require_batcher()
    except ShardServeError:  # loading or stopping: the app says so
        return None
    headers = scope["headers"]
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit() or int(value) > model.settings.max_body_bytes:
                return None
            break
    rid = request_id_from(headers)
    body, error = _queue_full(queued, limit)
    total_ms = refused(
        model, error, started, request_id=rid.decode(), client=client_address(scope),
        route=scope.get("path", ""), protocol="http",
    )  # fmt: skip
    return rid, body, total_ms


_FULL: dict[tuple[int, int], tuple[bytes, QueueFullError]] = {}


def _queue_full(queued: int, limit: int) -> tuple[bytes, QueueFullError]:
    # The words of admission.check_headroom's refusal, one body per (queued, limit).
    known = _FULL.get((queued, limit))
    if known is None:
        if len(_FULL) > 64:
            _FULL.clear()
        message = queue_full_message(queued, limit)
        error = QueueFullError(message, retry_after_s=1.0)
        known = _FULL[(queued, limit)] = (orjson.dumps({"error": message}), error)
    return known
