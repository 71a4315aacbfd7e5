"""A client's ``traceparent`` with the sampled flag is honoured ``client_sampled_per_s`` times a
second at most; past that the request starts a trace of the server's own, linked to the
client's span, which the server's sampler decides (here: never, as a 0 ratio would)."""

from __future__ import annotations

import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

from serving.telemetry.stamp import Stamp
from serving.telemetry.traces import Tracer

CLIENT_TRACE = f"{0xC0FFEE:032x}"
SAMPLED = f"00-{CLIENT_TRACE}-{0xAB:016x}-01"
NOT_SAMPLED = f"00-{CLIENT_TRACE}-{0xAB:016x}-00"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def started(tracer: Tracer, traceparent: str | None) -> Stamp:
    stamp = Stamp(time.perf_counter())
    tracer.request(stamp, traceparent, None)
    return stamp


def test_a_clients_sampled_flag_is_honoured_up_to_the_rate_then_the_server_decides() -> None:
    clock = Clock()
    # The server's own sampler records no root: only the client's flag could make a trace.
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    tracer = Tracer(provider, client_sampled_per_s=2.0, clock=clock)
    stamps = [started(tracer, SAMPLED) for _ in range(10)]
    assert [s.trace_id for s in stamps] == [CLIENT_TRACE] * 2 + [None] * 8
    assert not stamps[-1].span.get_span_context().trace_flags.sampled
    clock.now += 0.5  # one more token
    assert [started(tracer, SAMPLED).trace_id for _ in range(2)] == [CLIENT_TRACE, None]


def test_past_the_rate_the_request_is_a_trace_of_its_own_linked_to_the_clients() -> None:
    # The server's sampler records every root here: the span past the rate is recorded, in a
    # trace the server drew, with a link to the client's span.
    tracer = Tracer(TracerProvider(), client_sampled_per_s=1.0, clock=Clock())
    first, over = started(tracer, SAMPLED), started(tracer, SAMPLED)
    assert first.trace_id == CLIENT_TRACE
    assert over.trace_id is not None and over.trace_id != CLIENT_TRACE
    (link,) = over.span.links
    assert f"{link.context.trace_id:032x}" == CLIENT_TRACE


def test_at_zero_no_client_forces_a_trace_and_an_unsampled_parent_costs_no_token() -> None:
    provider = TracerProvider(sampler=ParentBased(ALWAYS_OFF))
    assert started(Tracer(provider, client_sampled_per_s=0.0), SAMPLED).trace_id is None
    tracer = Tracer(provider, client_sampled_per_s=1.0, clock=Clock())
    unsampled = started(tracer, NOT_SAMPLED)
    assert f"{unsampled.span.get_span_context().trace_id:032x}" == CLIENT_TRACE  # its trace
    assert started(tracer, SAMPLED).trace_id == CLIENT_TRACE
