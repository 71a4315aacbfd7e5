"""What every predict-like route shares (``/predict``, ``:predict``, V2 ``infer``): admission
from the headers, the deadline, the request id, the error-to-status answer and the latency
metric. Each protocol brings only its ``work``: read, decode, submit, encode.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from serving.canary.blame import version_failed
from serving.errors import InvalidInputError, PayloadTooLargeError, QueueFullError, ShardServeError
from serving.http.admission import check_headroom, check_length, request_deadline
from serving.http.fast import FastRequest, ModelRef
from serving.http.model import ModelDirectory, ModelHandle, RequestMetrics
from serving.http.replies import (
    ClientGone,
    Reply,
    error_reply,
    log_failure,
    send_reply,
    unexpected_reply,
)
from serving.settings.lengths import served_max_length

if TYPE_CHECKING:
    import numpy as np

    from serving.batching.batcher import Batcher

__all__ = ["Work", "check_sequence_length", "count_routed", "serve_prediction"]

# A deadline's timer may fire up to the event loop's clock resolution early.
_TIMER_SLACK_S = 0.001

# (request, model, its batcher, deadline as time.monotonic()) -> the answer
Work = Callable[[FastRequest, ModelHandle, "Batcher", float], Awaitable[Reply]]


async def serve_prediction(
    request: FastRequest, models: ModelDirectory, ref: ModelRef, work: Work
) -> None:
    """Answer one predict-like request for the model (version, or label) ``ref`` names."""
    started = time.perf_counter()
    rid = request.rid
    try:
        model = models.model(ref.name, ref.version, ref.label)
    except ShardServeError as exc:  # no such model: nothing of a model to count it in
        await send_reply(request.send, rid, *error_reply(exc, rid))
        return
    metrics = model.metrics
    # The server's own deadline, a moment before the request's: a 504 before it was a deadline
    # the client shortened, not the version's failure (``count_routed``).
    own_deadline = time.monotonic() + model.settings.request_timeout_ms / 1000.0
    error: Exception | None = None
    try:
        batcher = model.require_batcher()
        settings = model.settings
        # Admission from the headers alone: a refused request costs no body read, no decode.
        check_length(request.content_length, settings.max_body_bytes)
        try:
            check_headroom(batcher)
        except QueueFullError:
            metrics.reject("queue_full")
            raise
        deadline = request_deadline(request.timeout_ms, settings)
        with model.admitted.hold():  # the model's drain waits for it (``Admitted``)
            reply = await work(request, model, batcher, deadline)
    except ClientGone:
        metrics.reject("client_gone")
        log_failure(rid.decode(), 499, "the client went away before its answer was ready")
        reply = (499, b"", b"text/plain", [])
    except ShardServeError as exc:
        if isinstance(exc, InvalidInputError | PayloadTooLargeError):
            metrics.reject("invalid_input")
        error = exc
        reply = error_reply(exc, rid)
    except Exception as exc:
        error = exc
        reply = unexpected_reply(request.scope, exc)
    status, body, content_type, headers = reply
    seconds = time.perf_counter() - started
    metrics.observe_latency(status, seconds)
    if ref.version is None and ref.label is None:  # the server chose its version
        count_routed(metrics, status, error, own_deadline, seconds)
    await send_reply(request.send, rid, status, body, content_type, headers)


def count_routed(
    metrics: RequestMetrics,
    status: int,
    error: BaseException | None,
    own_deadline: float,
    seconds: float,
) -> None:
    """Tell a canary's judge how a request the server chose the version of ended, where the
    version is to blame either way (``serving.canary.blame``). ``own_deadline``: the server's
    deadline for it (``time.monotonic()``), ``request_timeout_ms`` from its admission."""
    past = time.monotonic() >= own_deadline - _TIMER_SLACK_S
    failed = version_failed(status, error, past_own_deadline=past)
    if failed is not None:
        metrics.observe_routed(failed, seconds)


def check_sequence_length(
    inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]], model: ModelHandle
) -> None:
    """400 for an input longer than ``max_sequence_length`` (else the model's own bound) in a
    dimension the model leaves unknown: the memory plan and the warm-up were made at that
    length (every protocol, after decoding, before submitting). ``inputs``: arrays of stacked
    rows, or a ragged request's rows, one dict each without the batch dimension."""
    limit = served_max_length(model.settings.max_sequence_length, model.signature)
    if isinstance(inputs, Mapping):
        reason = model.signature.too_long(inputs, limit)
    else:
        reason = _row_too_long(inputs, model, limit)
    if reason is not None:
        raise InvalidInputError(reason)


def _row_too_long(
    rows: Sequence[Mapping[str, np.ndarray]], model: ModelHandle, limit: int
) -> str | None:
    unknown = [
        (spec.name, axis)
        for spec in model.signature.inputs
        for axis, want in enumerate(spec.shape)
        if want is None
    ]
    for index, row in enumerate(rows):
        for name, axis in unknown:
            length = row[name].shape[axis]
            if length > limit:
                return (
                    f"instance {index} of input {name!r} has length {length} (row shape "
                    f"{tuple(row[name].shape)}), over max_sequence_length={limit}, the longest "
                    f"this server takes; send at most {limit}"
                )
    return None
