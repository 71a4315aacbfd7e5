"""What the generating routes share: the generation's deadline, and tokens streamed to the
client as server-sent events (the OpenAI routes' ``"stream": true``, V2's ``generate_stream``).

A stream is the work of one request through the data plane: its refusals and the failures met
before its first token are the plain error answers of the other routes (status and body); from
its first token on it is ``200 text/event-stream``, one ``data: {...}`` event per choice that
has news each time the client can take more (tokens coalesce while it reads slower than the
model generates), a later failure an error event, and ``data: [DONE]`` last. The data plane is
then handed ``STREAMED``: the transport sends nothing more. A client that hangs up mid-stream
cancels the work (``FastRequest.until_disconnect``): its sequences leave at the end of the step
in flight.

Backpressure: a client that stops reading blocks only its own writes (the server's flow
control), never a step: its tokens wait in its own queue, at most its ``max_tokens``. Its
writes are bounded in time by the generation's deadline (and ``_LAST_WRITE_S`` more for the
last event): past it the stream is cut off and its connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson

from serving.errors import DeadlineExceededError, ShardServeError
from serving.generation.text_run import ChoiceDelta, TextRun
from serving.http.fast import FastRequest
from serving.http.replies import REQUEST_ID_HEADER, ClientGone, Reply, log_failure
from serving.telemetry.stamp import CURRENT

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = [
    "STREAMED",
    "STREAMED_KEY",
    "EventSource",
    "generation_deadline",
    "outcome",
    "stream_events",
]

log = logging.getLogger("shardserve")
EVENT_STREAM = b"text/event-stream"
# Set in the ASGI scope once a stream's response has started: nothing else may be sent.
STREAMED_KEY = "shardserve.streamed"
# What a streaming work hands the data plane: its answer went out already.
STREAMED: Reply = (200, b"", EVENT_STREAM, [])
_DONE = b"data: [DONE]\n\n"
# How long past the generation's deadline the stream's last event may take to be written (the
# deadline's own error event is written after it).
_LAST_WRITE_S = 1.0


class EventSource:
    """A protocol's events of a stream: ``chunks`` for each batch of deltas, ``error`` for a
    failure once the stream has started, ``last`` before ``[DONE]`` (a usage chunk)."""

    def __init__(
        self,
        chunks: Callable[[list[ChoiceDelta]], list[object]],
        error: Callable[[ShardServeError], object],
        last: Callable[[TextRun], list[object]] = lambda _: [],
        done: bool = True,
    ) -> None:
        self.chunks = chunks
        self.error = error
        self.last = last
        self.done = done  # ends with ``data: [DONE]`` (OpenAI's; V2's generate_stream has none)


def _events(objects: list[object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objects)


async def stream_events(request: FastRequest, run: TextRun, source: EventSource) -> Reply:
    """Run ``run`` and stream its deltas to the client (this request's work, under
    ``until_disconnect``); ``STREAMED`` once the stream has ended. The run's deadline bounds
    the client's reading too."""
    write_by = None
    if run.deadline is not None:
        # The loop's clock for asyncio.timeout_at (no task per write, as wait_for would make).
        left = run.deadline - time.monotonic()
        write_by = asyncio.get_running_loop().time() + left + _LAST_WRITE_S

    cut_off = False
    reasons: set[str] = set()
    failure: BaseException | None = None

    async def send(message: dict[str, object]) -> None:
        nonlocal cut_off
        try:
            async with asyncio.timeout_at(write_by):
                await request.send(message)
        except TimeoutError:
            log.info(
                "request %s: its client read too slowly to take its stream by the deadline; "
                "cut off",
                request.request_id,
            )
            cut_off = True
            raise ClientGone from None

    try:
        run.start()
        deltas = await run.next()  # a failure before the first token: a plain error answer
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", EVENT_STREAM),
                    (b"cache-control", b"no-cache"),
                    (REQUEST_ID_HEADER, request.rid),
                ],
            }
        )
        request.scope[STREAMED_KEY] = True
        while deltas is not None:
            reasons.update(d.finish_reason for d in deltas if d.finish_reason is not None)
            body = _events(source.chunks(deltas))
            if body:
                await send({"type": "http.response.body", "body": body, "more_body": True})
            try:
                deltas = await run.next()
            except ShardServeError as exc:
                failure = exc
                log_failure(request.request_id, exc.status_code, exc.message)
                tail = _events([source.error(exc)])
                break
            except Exception as exc:
                failure = exc
                log.error("request %s: a stream failed", request.request_id, exc_info=exc)
                error = ShardServeError("internal server error; see the server log")
                tail = _events([source.error(error)])
                break
        else:
            tail = _events(source.last(run))
        if source.done:
            tail += _DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return STREAMED
    except BaseException as exc:
        failure = failure or exc
        raise
    finally:
        await run.close()
        _ended(run, "deadline" if cut_off else outcome(failure, reasons))


def outcome(failure: BaseException | None, reasons: set[str]) -> str:
    """How a stream ended (``shardserve_generation_streams_total``): its choices' finish
    reason where they share one, ``done`` where they differ; else what cut it short."""
    if failure is None:
        return reasons.pop() if len(reasons) == 1 else "done"
    if isinstance(failure, DeadlineExceededError):
        return "deadline"
    if isinstance(failure, asyncio.CancelledError | ClientGone):
        return "cancelled"
    return "error"


def _ended(run: TextRun, how: str) -> None:
    """Count the stream, and put its tokens in its request's stamp (the access log's)."""
    stamp = CURRENT.get()
    if stamp is not None:
        stamp.tokens = run.completion_tokens
        stamp.finish = how
    observer = run.observer
    if observer is not None:
        observer.observe_stream(how)


def generation_deadline(header: str | None, settings: Settings) -> float:
    """A generation's deadline (``time.monotonic()``): ``generation_timeout_ms`` from now, or the
    ``X-Request-Timeout-Ms`` header's if sooner (the transport has refused a malformed one)."""
    timeout_ms = settings.generation_timeout_ms
    if header is not None:
        try:
            asked = float(header)
        except ValueError:
            asked = math.inf
        if 0 < asked < math.inf:
            timeout_ms = min(timeout_ms, asked)
    return time.monotonic() + timeout_ms / 1000.0
