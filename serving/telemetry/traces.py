"""The server's spans: one per request, one per batch linked to its requests, one per re-run of
poison isolation; imported only where tracing is on (``serving.telemetry.setup``).

A batching server's one trace question is "which batch did my request ride in": OpenTelemetry's
answer is a batch span (a root of its own trace) with a *link* to each member request's span,
and the stage spans (made in the stage actors' processes, ``shards.tracing``) under it. A batch
span is made only where a member request is sampled, and is then always recorded
(``shards.tracing.tracer_provider``). A request's span starts under the client's W3C
``traceparent`` (a new trace without one) and gets, when it ends, a child for its time in the
queue (with why its batch closed), timed from the batcher's stamps (``serving.telemetry.stamp``).
A generating request has no batch: each of its sequences gets a span under the request's
(``sequence``: its time queued for a slot, its prefill, its decode steps, why it ended), made
when it ends from the scheduler's instants.

A client's sampled flag is honoured ``client_sampled_per_s`` times a second at most (a token
bucket): past that, a request that asks starts a trace of the server's own, *linked* to the
client's span, and the server's sampler decides it as any root (a ratio over a trace id the
server drew, not the client's). Honoured always, any client could force full tracing's cost
(1.76x the front end's CPU per request, docs/benchmarks.md) at any configured ratio.

A canary's rollback is a short span of its own (``canary.rollback``, a root, always recorded
like a batch span): the judge's verdict comes from many requests' outcomes, and an admin's from
none, so no request's trace owns it; its attributes say which version left, for what reason.

Spans carry one-line reasons only: a failed request's status says what the client was told.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from shards.tracing import (
    BATCH,
    ROLLBACK,
    BatchTrace,
    context_from,
    traceparent_of,
    tracer_provider,
)

if TYPE_CHECKING:
    from serving.telemetry.stamp import Segment, Stamp

__all__ = ["Tracer"]


def _ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` instant as the epoch nanoseconds spans take."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _perf_ns(perf_s: float) -> int:
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class _Bucket:
    """``per_s`` tokens a second, as many (at least one) held at most."""

    __slots__ = ("_at", "_clock", "_held", "_most", "_per_s")

    def __init__(self, per_s: float, clock: Callable[[], float]) -> None:
        self._per_s = per_s
        self._most = max(1.0, per_s)
        self._held = self._most if per_s > 0 else 0.0
        self._clock = clock
        self._at = clock()

    def take(self) -> bool:
        if self._per_s <= 0:
            return False
        now = self._clock()
        self._held = min(self._most, self._held + (now - self._at) * self._per_s)
        self._at = now
        if self._held < 1.0:
            return False
        self._held -= 1.0
        return True


class Tracer:
    """Makes the server's spans with this process's provider (``shards.tracing``);
    ``client_sampled_per_s``: a client's sampled flag honoured at most this often (see the
    module's docstring)."""

    def __init__(
        self,
        provider: Any | None = None,
        client_sampled_per_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tracer = (provider or tracer_provider()).get_tracer("shardserve")
        self._client_sampled = _Bucket(client_sampled_per_s, clock)

    # --- requests

    def request(self, stamp: Stamp, traceparent: str | None, tracestate: str | None) -> None:
        """Start ``stamp``'s request span, under the client's trace where it sent one."""
        parent = context_from(traceparent, tracestate) if traceparent else None
        links: list[Link] = []
        if parent is not None:
            asked = trace.get_current_span(parent).get_span_context()
            if asked.is_valid and asked.trace_flags.sampled and not self._client_sampled.take():
                parent, links = Context(), [Link(asked, {"shardserve.client_sampled": True})]
        span = self._tracer.start_span(
            "infer",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=_perf_ns(stamp.started),
            links=links,
        )
        stamp.span = span
        ctx = span.get_span_context()
        if ctx.trace_flags.sampled:
            stamp.trace_id = f"{ctx.trace_id:032x}"

    def request_end(
        self,
        stamp: Stamp,
        attributes: dict[str, str | int | float | bool],
        failed: str | None,
    ) -> None:
        """End ``stamp``'s span with ``attributes``; ``failed``: the one-line reason it failed
        (an error status), else ``None``."""
        span = stamp.span
        if not span.is_recording():
            span.end()
            return
        name = attributes.get("shardserve.model")
        if name:
            span.update_name(f"infer {name}")
        span.set_attributes(attributes)
        if stamp.sent:
            queued = self._tracer.start_span(
                "queue",
                context=trace.set_span_in_context(span),
                start_time=_ns(stamp.sent - stamp.waited_s),
                attributes={
                    "shardserve.close_reason": stamp.reason,
                    "shardserve.batch_rows": stamp.batch_rows,
                    "shardserve.attempts": stamp.attempts,
                },
            )
            queued.end(end_time=_ns(stamp.sent))
        if failed is not None:
            span.set_status(Status(StatusCode.ERROR, failed))
        span.end()

    # --- generation

    def sequence(
        self,
        stamp: Stamp,
        *,
        arrived: float,
        admitted: float | None,
        first_token: float | None,
        ended: float,
        attributes: dict[str, str | int | float | bool],
        failed: bool,
    ) -> None:
        """A generated sequence's span under its request's (``time.monotonic()`` instants):
        ``queued`` till it took a slot, ``prefill`` till its first token, ``decode`` till it
        ended (``attributes`` say its steps and why it ended); only the phases it reached."""
        if not stamp.span.is_recording():
            return
        # One offset for all its instants: converted one by one, their order could flip.
        offset = time.time_ns() - int(time.monotonic() * 1e9)

        def _ns(monotonic_s: float) -> int:
            return offset + int(monotonic_s * 1e9)

        span = self._tracer.start_span(
            "sequence",
            context=trace.set_span_in_context(stamp.span),
            start_time=_ns(arrived),
            attributes=attributes,
        )
        under = trace.set_span_in_context(span)
        phases: tuple[tuple[str, float | None, float, dict[str, Any]], ...] = (
            ("queued", arrived, admitted if admitted is not None else ended, {}),
            ("prefill", admitted, first_token if first_token is not None else ended, {}),
            (
                "decode",
                first_token,
                ended,
                {"shardserve.steps": attributes.get("shardserve.decode_steps", 0)},
            ),
        )
        for name, start, end, extra in phases:
            if start is None:
                break
            phase = self._tracer.start_span(
                name, context=under, start_time=_ns(start), attributes=extra
            )
            phase.end(end_time=_ns(max(start, end)))
        if failed:
            span.set_status(Status(StatusCode.ERROR, str(attributes["shardserve.finish_reason"])))
        span.end(end_time=_ns(ended))

    # --- batches

    def batch(
        self, segments: Sequence[Segment], attributes: dict[str, str | int | float | bool]
    ) -> Any:
        """Start a batch's span, linked to its requests' spans, and carry its context to the
        stage calls (``shards.tracing.BATCH``, in this batch's task); ``None`` where no member
        request is sampled."""
        links = []
        sampled = False
        for request, _, _ in segments:
            stamp = request.stamp
            if stamp is None or stamp.span is None:
                continue
            ctx = stamp.span.get_span_context()
            sampled = sampled or bool(ctx.trace_flags.sampled)
            links.append(Link(ctx, {"shardserve.request_id": request.request_id or ""}))
        if not sampled:
            return None
        span = self._tracer.start_span(
            "batch",
            context=Context(),  # a root: the batch belongs to no one request's trace
            kind=SpanKind.INTERNAL,
            links=links,
            attributes={**attributes, "shardserve.batch": True},
        )
        BATCH.set(BatchTrace(traceparent_of(span), span))
        return span

    def batch_end(self, span: Any, clean: bool, isolated: int) -> None:
        """End a batch span, with what the replica set noted of it."""
        noted = BATCH.get()
        _take_notes(span, noted)
        span.set_attribute("shardserve.isolated", isolated)
        if not clean and span.status.status_code is not StatusCode.ERROR:
            span.set_status(Status(StatusCode.ERROR, "a run of the batch failed"))
        span.end()

    def batch_failed(self, message: str, rows: int, splitting: bool) -> None:
        """A run of the batch in flight failed with ``message``: an event, and its status."""
        noted = BATCH.get()
        if noted is None or noted.span is None:
            return
        noted.span.add_event(
            "batch failed", {"shardserve.rows": rows, "shardserve.isolating": splitting}
        )
        noted.span.set_status(Status(StatusCode.ERROR, message))

    @contextlib.contextmanager
    def rerun(self, segments: Sequence[Segment]) -> Iterator[None]:
        """A span for one re-run of poison isolation (half of a failed batch), under the span
        of the run that failed; the stage calls it makes go under it."""
        parent = BATCH.get()
        if parent is None or parent.span is None:
            yield
            return
        rows = sum(n for _, _, n in segments)
        ids = ",".join(r.request_id or "-" for r, _, _ in segments)
        span = self._tracer.start_span(
            "isolate",
            context=trace.set_span_in_context(parent.span),
            attributes={"shardserve.rows": rows, "shardserve.request_ids": ids},
        )
        token = BATCH.set(BatchTrace(traceparent_of(span), span))
        try:
            yield
        finally:
            _take_notes(span, BATCH.get())
            BATCH.reset(token)
            span.end()

    # --- the repository's moves

    def rollback(self, model: str, canary: str, stable: str, reason: str, detail: str) -> None:
        """A canary rolled back (``reason``: ``errors``, ``latency``, ``manual``; ``detail``:
        the judge's or the admin's one line), as a span of its own."""
        span = self._tracer.start_span(
            ROLLBACK,
            context=Context(),
            kind=SpanKind.INTERNAL,
            attributes={
                "shardserve.model": model,
                "shardserve.version": canary,
                "shardserve.stable_version": stable,
                "shardserve.rollback_reason": reason,
                "shardserve.rollback_detail": detail,
            },
        )
        span.add_event("rollback", {"shardserve.rollback_reason": reason})
        span.end()


def _take_notes(span: Any, noted: BatchTrace | None) -> None:
    if noted is None:
        return
    if noted.attributes:
        span.set_attributes(noted.attributes)
    for name, attributes in noted.events:
        span.add_event(name, attributes)
