"""The data plane: one inference request, the same for every protocol and transport.

TF Serving's REST predict, V2's HTTP infer and V2's gRPC ``ModelInfer`` all call ``infer``
(KServe's ``DataPlane``, which its ``protocol/rest`` and ``protocol/grpc`` share, is the
model). It owns, in this order: the look-up of the served version (name, version or label),
admission (the model ready, a declared body within ``max_body_bytes``, room in the queue), the
deadline, the admission held across decode and submit (the model's drain waits for it), the
per-request metrics (rejects, latency by status), what a canary's judge is told
(``serving.canary.blame``), and an error turned into a ``Failure`` that names no transport.

A protocol brings its ``work`` (decode, ``submit`` or ``submit_ragged``, encode): the data plane's
``submit`` is the one way rows reach the batcher, and holds them to the length the model serves and
the deadline to the client's own timeout, so that no protocol can forget either. A request refused
before ``infer`` could take it (HTTP's queue-full answer from the headers, a gRPC message refused
before it was parsed) is counted by ``refused``, as ``infer`` counts one: its reject, its latency
and its access-log line. A transport brings a ``Transport``: the client's deadline, the request id
for the log, and the answer (an HTTP reply, a gRPC message or status). ``Failure.status`` is the
HTTP status of the outcome, which the metrics count in either transport; gRPC maps it to its own
codes. A cancelled request (a gRPC client that went away) is counted as one gone and cancelled on;
HTTP's hang-up arrives as ``ClientGone`` and is answered 499.

The hot path adds no await and no object to the work's: ``infer`` is the coroutine a route
awaits (``serving.protocols.rest.serve_prediction`` returns it, without a frame of its own),
and a success goes to the transport as the work's own answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from serving.canary.blame import CLIENT_GONE, version_failed
from serving.errors import (
    InvalidInputError,
    ModelInputError,
    PayloadTooLargeError,
    QueueFullError,
    ShardServeError,
)
from serving.http.admission import check_headroom, check_length
from serving.http.replies import ClientGone, log_failure
from serving.protocols.contract import ModelDirectory, ModelHandle, RequestMetrics
from serving.protocols.ragged import Row, submit_rows
from serving.settings.lengths import served_max_length
from serving.telemetry import active
from serving.telemetry.access_log import reject_reason
from serving.telemetry.stamp import CURRENT, Stamp

if TYPE_CHECKING:
    import numpy as np

    from serving.batching.batcher import Batcher
    from serving.generation.engine import Generator
    from serving.settings.config import Settings

__all__ = [
    "Failure",
    "GenerateWork",
    "Transport",
    "Work",
    "count_routed",
    "generate",
    "infer",
    "refused",
    "submit",
    "submit_ragged",
]

R = TypeVar("R")  # a transport's request (HTTP's FastRequest, a gRPC call)
A = TypeVar("A")  # what a protocol's work answers (an HTTP reply, a gRPC message)
T = TypeVar("T")  # what the transport's answer gives its caller
R_contra = TypeVar("R_contra", contravariant=True)
A_contra = TypeVar("A_contra", contravariant=True)
T_co = TypeVar("T_co", covariant=True)

# A deadline's timer may fire up to the event loop's clock resolution early.
_TIMER_SLACK_S = 0.001
_GONE_MESSAGE = "the client went away before its answer was ready"

# (request, model, its batcher, deadline as time.monotonic()) -> the answer
Work = Callable[[R, ModelHandle, "Batcher", float], Awaitable[A]]
# (request, model, its generator, deadline) -> the answer: a generate request's work
GenerateWork = Callable[[R, ModelHandle, "Generator", float], Awaitable[A]]


class Failure:
    """An inference that ended without an answer, in no transport's terms.

    ``status``: the HTTP status it is counted (and, over HTTP, answered) with. ``error``: the
    refusal or failure with its message for the client; ``None`` with ``unexpected``, an error
    of no known kind (500: the client is told nothing of it, the transport logs it), or with
    neither, the client that went away (499)."""

    __slots__ = ("error", "status", "unexpected")

    def __init__(
        self, status: int, error: ShardServeError | None, unexpected: Exception | None = None
    ) -> None:
        self.status = status
        self.error = error
        self.unexpected = unexpected


_GONE = Failure(CLIENT_GONE, None)


class Transport(Protocol[R_contra, A_contra, T_co]):
    """What a transport does around the data plane: one object per transport, made once."""

    def deadline(self, request: R_contra, settings: Settings) -> float:
        """The request's deadline (``time.monotonic()``): ``request_timeout_ms`` from now, or
        the client's if sooner; ``InvalidInputError`` for a malformed one."""
        ...

    def answer(
        self, request: R_contra, outcome: A_contra | Failure, stamp: Stamp
    ) -> Awaitable[T_co]:
        """Send (HTTP) or give (gRPC) the work's answer, or the failure's, with the stamp's
        ``Server-Timing``; set ``stamp.bytes_out`` (where the access log is on: gRPC)."""
        ...

    def trace_context(self, request: R_contra) -> tuple[str | None, str | None]:
        """The client's W3C ``traceparent`` and ``tracestate`` (asked only with tracing on)."""
        ...

    def describe(self, request: R_contra) -> tuple[str, str, str, int]:
        """(route, protocol, client address, bytes in), for the access log (asked only with
        it on)."""
        ...

    def request_id(self, request: R_contra) -> str:
        """The request's id, for the log."""
        ...


async def infer(
    models: ModelDirectory,
    name: str | None,
    version: str | None,
    label: str | None,
    request: R,
    body_length: str | None,
    work: Work[R, A],
    transport: Transport[R, A, T],
    generates: bool = False,
) -> T:
    """Serve one inference request for the version (or label) ``name`` names (``version`` and
    ``label`` ``None``: the server's choice, a turn of a canary's split) with ``work``.

    ``body_length``: the size the client declared (HTTP's ``Content-Length``), refused from it
    past ``max_body_bytes``; ``None`` where the transport bounds the message itself (gRPC).
    ``generates``: a generate request (``generate``): the work is handed the version's
    generator, its iteration-level scheduler, in place of its batcher."""
    started = time.perf_counter()
    stamp = Stamp(started)
    CURRENT.set(stamp)  # the request's own task: its batcher's submit stamps it
    tracer = active.tracer
    if tracer is not None:
        tracer.request(stamp, *transport.trace_context(request))
    model: ModelHandle | None = None
    error: Exception | None = None
    outcome: A | Failure
    try:
        model = models.model(name, version, label)
    except ShardServeError as exc:  # no such model: nothing of a model to count it in
        error, status, outcome = exc, exc.status_code, Failure(exc.status_code, exc)
    else:
        metrics = model.metrics
        # The server's own deadline, a moment before the request's: a 504 before it was a
        # deadline the client shortened, not the version's failure (``count_routed``).
        own_deadline = time.monotonic() + model.settings.request_timeout_ms / 1000.0
        try:
            settings = model.settings
            if not generates:
                batcher: Any = model.require_batcher()
                # Admission from the headers alone: a refused request costs no body read, no
                # decode.
                check_length(body_length, settings.max_body_bytes)
                try:
                    check_headroom(batcher)
                except QueueFullError:
                    _reject(metrics, QueueFullError)
                    raise
            else:  # its work gets the version's generator (its scheduler) instead
                batcher = model.require_generator()
                check_length(body_length, settings.max_body_bytes)
                try:
                    batcher.check_headroom()
                except QueueFullError:
                    _reject(metrics, QueueFullError)
                    raise
            deadline = transport.deadline(request, settings)
            with model.admitted.hold():  # the model's drain waits for it (``Admitted``)
                outcome = await work(request, model, batcher, deadline)
            status = 200
        except ClientGone:
            metrics.reject("client_gone")
            log_failure(transport.request_id(request), CLIENT_GONE, _GONE_MESSAGE)
            status, outcome = CLIENT_GONE, _GONE
        except ShardServeError as exc:
            if isinstance(exc, InvalidInputError | PayloadTooLargeError):
                _reject(metrics, type(exc))
            error = exc
            status = exc.status_code
            outcome = Failure(status, exc)
        except Exception as exc:
            error = exc
            status, outcome = 500, Failure(500, None, exc)
        except BaseException:  # cancelled: the client went away (gRPC) or its deadline passed
            metrics.reject("client_gone")
            log_failure(transport.request_id(request), CLIENT_GONE, _GONE_MESSAGE)
            _count(metrics, CLIENT_GONE, None, own_deadline, started, version, label, stamp)
            stamp.status = CLIENT_GONE
            _finish(stamp, model, None, transport, request)
            raise
        _count(metrics, status, error, own_deadline, started, version, label, stamp)
    stamp.status = status
    if stamp.span is None and active.access_log is None:
        return await transport.answer(request, outcome, stamp)
    try:
        return await transport.answer(request, outcome, stamp)
    finally:
        _finish(stamp, model, error, transport, request)


def generate(
    models: ModelDirectory,
    name: str | None,
    version: str | None,
    label: str | None,
    request: R,
    body_length: str | None,
    work: GenerateWork[R, A],
    transport: Transport[R, A, T],
) -> Coroutine[Any, Any, T]:
    """Serve one generate request: ``infer``, its work handed the version's generator (a
    version that does not generate is refused there, 400). Returns ``infer``'s coroutine: no
    frame of its own."""
    return infer(
        models, name, version, label, request, body_length, cast(Work[R, A], work), transport, True
    )


def _finish(
    stamp: Stamp,
    model: ModelHandle | None,
    error: BaseException | None,
    transport: Transport[R, A, T],
    request: R,
) -> None:
    """End the request's span and write its access-log line, where either is on."""
    tracer, access = active.tracer, active.access_log
    name = model.name if model is not None else ""
    version = model.version if model is not None else ""
    if tracer is not None and stamp.span is not None:
        failed = None
        if stamp.status >= 500 or isinstance(error, ModelInputError):
            failed = error.message if isinstance(error, ShardServeError) else "internal error"
        tracer.request_end(
            stamp,
            {
                "shardserve.model": name,
                "shardserve.version": version,
                "shardserve.request_id": transport.request_id(request),
                "shardserve.rows": stamp.rows,
                "shardserve.batch_rows": stamp.batch_rows,
                "http.response.status_code": stamp.status,
            },
            failed,
        )
    if access is not None:
        route, protocol, client, bytes_in = transport.describe(request)
        access.line(
            stamp, request_id=transport.request_id(request), client=client, route=route,
            protocol=protocol, reject=reject_reason(error, stamp.status), model=name,
            version=version, bytes_in=bytes_in,
        )  # fmt: skip


def _count(
    metrics: RequestMetrics,
    status: int,
    error: Exception | None,
    own_deadline: float,
    started: float,
    version: str | None,
    label: str | None,
    stamp: Stamp,
) -> None:
    seconds = time.perf_counter() - started
    if stamp.trace_id is None:
        metrics.observe_latency(status, seconds)
    else:  # the bucket's exemplar: a sampled request's trace
        metrics.observe_latency(status, seconds, stamp.trace_id)
    if version is None and label is None:  # the server chose its version (a canary's split)
        count_routed(metrics, status, error, own_deadline, seconds)


def _reject(metrics: RequestMetrics, kind: type[ShardServeError]) -> None:
    """One more request refused for an error of ``kind``: ``queue_full`` for a full queue,
    ``invalid_input`` for a body or message the server does not take (``infer``, ``refused``)."""
    if issubclass(kind, QueueFullError):
        metrics.reject("queue_full")
    elif issubclass(kind, InvalidInputError | PayloadTooLargeError):
        metrics.reject("invalid_input")


def refused(
    model: ModelHandle | None,
    error: ShardServeError,
    started: float,
    *,
    request_id: str,
    client: str,
    route: str,
    protocol: str,
) -> float:
    """Count a request refused before ``infer`` could take it as ``infer`` counts one: its reject
    and its latency on the model it named, where there is one, and its access-log line, where
    the log is on. The refusals: HTTP's queue full, answered from the headers inside uvicorn's
    protocol (``serving.protocols.rest.refuse_from_headers``); a gRPC message over its model's
    limits, refused before it was parsed (``grpc_bounds``, ``grpc_call.refuse``). ``started``:
    the request's ``time.perf_counter()``; returns its total time (ms), for its
    ``Server-Timing``."""
    status = error.status_code
    seconds = time.perf_counter() - started
    if model is not None:
        metrics = model.metrics
        _reject(metrics, type(error))
        metrics.observe_latency(status, seconds)
    total_ms = seconds * 1000.0
    access = active.access_log
    if access is not None:
        stamp = Stamp(started)
        stamp.status = status
        access.line(
            stamp, request_id=request_id, client=client, route=route, protocol=protocol,
            reject=reject_reason(error, status), model=model.name if model is not None else "",
            version=model.version if model is not None else "", total_ms=total_ms,
        )  # fmt: skip
    return total_ms


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


def submit(
    inputs: dict[str, np.ndarray],
    model: ModelHandle,
    batcher: Batcher,
    deadline: float,
    request_id: str | None,
    timeout_s: float | None = None,
    since: float | None = None,
) -> Coroutine[Any, Any, dict[str, np.ndarray]]:
    """Hand a decoded request's rows to the batcher (its coroutine: no frame of its own), the
    one way a protocol's work submits: 400 for an input longer than the model serves
    (``_check_sequence_length``); ``timeout_s``: the client's own timeout carried in the
    request (V2's ``timeout`` parameter), which tightens ``deadline``, counted from ``since``
    (``time.monotonic()``: where the protocol read it), else from now."""
    _check_sequence_length(inputs, model)
    if timeout_s is not None:
        start = time.monotonic() if since is None else since
        deadline = min(deadline, start + timeout_s)
    return batcher.submit(inputs, deadline=deadline, request_id=request_id)


def submit_ragged(
    rows: list[Row], model: ModelHandle, batcher: Batcher, deadline: float, request_id: str | None
) -> Coroutine[Any, Any, list[Row]]:
    """``submit`` for a ragged request: one dict of arrays per row, rows of different lengths
    (``serving.protocols.ragged.submit_rows``), each held to the length the model serves."""
    _check_sequence_length(rows, model)
    return submit_rows(batcher.submit_lengths, batcher.length_padding, rows, deadline, request_id)


def _check_sequence_length(
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
