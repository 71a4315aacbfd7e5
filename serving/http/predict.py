"""What every predict-like HTTP route shares (``/predict``, ``:predict``, V2 ``infer``):
admission from the headers, the deadline, the request id, the error-to-status answer and the
latency metric. Each protocol brings only its ``work``: read, decode, submit, encode.

The routes run on raw ASGI (``serving.http.raw``); the metric children are taken once per
status, not looked up by label on every request."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from serving.batching.batcher import Batcher
from serving.config import Settings
from serving.errors import (
    InvalidInputError,
    PayloadTooLargeError,
    QueueFullError,
    ShardServeError,
)
from serving.http.raw import FastRequest, Reply, error_reply, send_reply, unexpected_reply
from serving.http.replies import ClientGone, check_headroom, log_failure
from serving.server.runner import ModelRunner
from serving.server.state import ServerState

# (request, batcher, runner, deadline as time.monotonic(), request id) -> the answer
Work = Callable[[FastRequest, Batcher, ModelRunner, float, str], Awaitable[Reply]]


async def serve_prediction(
    request: FastRequest,
    state: ServerState,
    work: Work,
    check: Callable[[], None] | None = None,
) -> None:
    """Answer one predict-like request; ``check`` (the model name, say) runs first."""
    settings = state.settings
    started = time.perf_counter()
    metrics = state.metrics
    rid = request.rid
    try:
        if check is not None:
            check()
        batcher = state.require_batcher()
        runner = state.runner
        assert runner is not None
        # Admission from the headers alone: a refused request costs no body read, no decode.
        check_length(request.content_length, settings.max_body_bytes)
        try:
            check_headroom(batcher)
        except QueueFullError:
            metrics.reject("queue_full")
            raise
        deadline = request_deadline(request.timeout_ms, settings)
        reply = await work(request, batcher, runner, deadline, rid.decode())
    except ClientGone:
        metrics.reject("client_gone")
        log_failure(rid.decode(), 499, "the client went away before its answer was ready")
        reply = (499, b"", b"text/plain", [])
    except ShardServeError as exc:
        if isinstance(exc, InvalidInputError | PayloadTooLargeError):
            metrics.reject("invalid_input")
        reply = error_reply(exc, rid)
    except Exception as exc:
        reply = unexpected_reply(request, exc)
    status, body, content_type, headers = reply
    metrics.observe_latency(status, time.perf_counter() - started)
    await send_reply(request.send, rid, status, body, content_type, headers)


def check_length(length: str | None, limit: int) -> None:
    if length is not None and length.isdigit() and int(length) > limit:
        raise PayloadTooLargeError(f"body of {length} bytes is over the limit of {limit} bytes")


def request_deadline(header: str | None, settings: Settings) -> float:
    timeout_ms = settings.request_timeout_ms
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = float("nan")
        if not asked > 0:
            raise InvalidInputError(
                f"header X-Request-Timeout-Ms must be a positive number of ms, got {header!r}"
            )
        timeout_ms = min(timeout_ms, asked)
    return time.monotonic() + timeout_ms / 1000.0
