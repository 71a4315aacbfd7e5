"""What every predict-like HTTP route shares (``/predict``, ``:predict``, V2 ``infer``):
admission from the headers, the deadline, the request id, the error-to-status answer and the
latency metric. Each protocol brings only its ``work``: read, decode, submit, encode."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from serving.batcher import Batcher
from serving.errors import InvalidInputError, PayloadTooLargeError, QueueFullError, ShardServeError
from serving.http_io import (
    ClientGone,
    check_content_length,
    check_headroom,
    error_response,
    log_failure,
    request_deadline,
    request_id,
    unexpected_response,
)
from serving.runner import ModelRunner
from serving.state import ServerState

# Bodies above this are decoded on a worker thread: parsing 1 MiB of JSON holds the event loop
# for milliseconds, and batch timers (and every other request) would wait for it.
INLINE_DECODE_BYTES = 256 * 1024

# (request, batcher, runner, deadline as time.monotonic(), request id) -> the answer
Work = Callable[[Request, Batcher, ModelRunner, float, str], Awaitable[Response]]


async def serve_prediction(
    request: Request,
    state: ServerState,
    work: Work,
    check: Callable[[], None] | None = None,
) -> Response:
    """Answer one predict-like request; ``check`` (the model name, say) runs first."""
    settings = state.settings
    started = time.perf_counter()
    status = "500"
    rid = request_id(request)
    try:
        if check is not None:
            check()
        batcher = state.require_batcher()
        runner = state.runner
        assert runner is not None
        # Admission from the headers alone: a refused request costs no body read, no decode.
        check_content_length(request, settings.max_body_bytes)
        try:
            check_headroom(batcher)
        except QueueFullError:
            state.metrics.rejects.labels("queue_full").inc()
            raise
        deadline = request_deadline(request, settings)
        response = await work(request, batcher, runner, deadline, rid)
        status = "200"
        return response
    except ClientGone:
        status = "499"
        state.metrics.rejects.labels("client_gone").inc()
        log_failure(rid, 499, "the client went away before its answer was ready")
        return Response(status_code=499)
    except ShardServeError as exc:
        status = str(exc.status_code)
        if isinstance(exc, InvalidInputError | PayloadTooLargeError):
            state.metrics.rejects.labels("invalid_input").inc()
        return error_response(exc, rid)
    except Exception as exc:
        return unexpected_response(request, exc)
    finally:
        state.metrics.request_latency.labels(status).observe(time.perf_counter() - started)
