"""OpenTelemetry on both sides of the Ray boundary: the tracer provider a process exports its
spans with, and the batch's trace context carried explicitly to each stage call.

The driver (the server) and every stage actor build their provider the same way, from the
standard variables alone (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``..._TRACES_ENDPOINT``,
``..._PROTOCOL``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``, ``..._ARG``,
``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_SDK_DISABLED=true`` wins), which the server sets before
Ray starts and passes to the workers in ``runtime_env`` (``otel_env``: those the exporter reads,
never its headers, which hold credentials: a ``runtime_env`` is readable by whoever reaches Ray's
GCS or dashboard). The context crosses as
a plain W3C ``traceparent`` string, an argument of the stage call itself: Ray's own tracing
hook is alpha and skips generators, and it would put Ray's spans between ours.

Nothing here imports OpenTelemetry until a traced batch needs it: a stage call without a trace
context makes no span and imports nothing (``stage_span``). The driver marks the batch in
flight with ``BATCH`` (a context variable the replica reads, so that no signature between the
batcher and the replica changes); the replica set writes what it chose (the replica, a retry)
into the same record, which the batch span takes as attributes and events when it ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

__all__ = [
    "BATCH",
    "ROLLBACK",
    "BatchTrace",
    "missing_package",
    "note",
    "note_event",
    "otel_env",
    "stage_span",
    "tracer_provider",
    "wanted",
]

DEFAULT_SERVICE = "shardserve"
ROLLBACK = "canary.rollback"  # a span that the sampler always records, as a batch span
_lock = threading.Lock()
_providers: dict[str, Any] = {}


class BatchTrace:
    """The batch in flight, as the replica sees it: the ``traceparent`` its stage calls carry,
    and what the replica set notes for the batch span (attributes, events)."""

    __slots__ = ("attributes", "events", "span", "traceparent")

    def __init__(self, traceparent: str, span: Any = None) -> None:
        self.traceparent = traceparent
        self.span = span  # the driver's own span object for it (never sent to an actor)
        self.attributes: dict[str, str | int | float | bool] = {}
        self.events: list[tuple[str, dict[str, str | int | float | bool]]] = []


BATCH: ContextVar[BatchTrace | None] = ContextVar("shardserve_batch_trace", default=None)


def note(key: str, value: str | int | float | bool) -> None:
    """An attribute of the traced batch in flight (none: nothing)."""
    trace = BATCH.get()
    if trace is not None:
        trace.attributes[key] = value


def note_event(name: str, **attributes: str | int | float | bool) -> None:
    """An event on the traced batch in flight (a retry on another replica, a lost replica)."""
    trace = BATCH.get()
    if trace is not None:
        trace.events.append((name, attributes))


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Tracing is on where an OTLP endpoint is set, as for any OpenTelemetry-instrumented
    service; ``OTEL_SDK_DISABLED=true`` and ``OTEL_TRACES_EXPORTER=none`` turn it off."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


# What a stage actor's provider reads (``_build``, the exporters, the batch span processor).
_WORKER_OTEL = frozenset(
    {
        "OTEL_SDK_DISABLED",
        "OTEL_TRACES_EXPORTER",
        "OTEL_SERVICE_NAME",
        "OTEL_RESOURCE_ATTRIBUTES",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    }
)
_WORKER_OTEL_PREFIXES = ("OTEL_BSP_", "OTEL_SPAN_", "OTEL_ATTRIBUTE_")
_EXPORTER_KEYS = (
    "ENDPOINT",
    "PROTOCOL",
    "TIMEOUT",
    "COMPRESSION",
    "INSECURE",
    "CERTIFICATE",
    "CLIENT_CERTIFICATE",
    "CLIENT_KEY",
)
_WORKER_OTEL_EXPORTER = frozenset(
    f"OTEL_EXPORTER_OTLP_{part}{key}" for part in ("", "TRACES_") for key in _EXPORTER_KEYS
)


def otel_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenTelemetry variables a stage actor needs, for the workers' ``runtime_env``:
    where and how to export, the sampler, the resource. Not ``OTEL_EXPORTER_OTLP_HEADERS``
    (credentials): a private local Ray's workers inherit this process's environment anyway,
    and a cluster's nodes get them from their own (``ray start``'s environment)."""
    env = os.environ if environ is None else environ
    return {
        k: v
        for k, v in env.items()
        if k in _WORKER_OTEL or k in _WORKER_OTEL_EXPORTER or k.startswith(_WORKER_OTEL_PREFIXES)
    }


def missing_package(environ: Mapping[str, str] | None = None) -> str | None:
    """The OpenTelemetry module that tracing would need and is not installed, else ``None``
    (``pip install 'shardserve[tracing]'`` brings them)."""
    protocol, _ = export_target(environ)
    exporter = "grpc" if protocol == "grpc" else "http"
    for module in ("opentelemetry.sdk", f"opentelemetry.exporter.otlp.proto.{exporter}"):
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):  # a parent package missing, or blocked
            found = None
        if found is None:
            return module
    return None


def export_target(environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(protocol, endpoint) the exporter will use: ``grpc`` or ``http/protobuf``."""
    env = os.environ if environ is None else environ
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if protocol == "grpc":
            endpoint = base or "http://localhost:4317"
        else:
            endpoint = (base or "http://localhost:4318").rstrip("/") + "/v1/traces"
    return protocol, endpoint


def tracer_provider(service: str = DEFAULT_SERVICE) -> Any:
    """This process's tracer provider, built once from the standard variables: OTLP over HTTP
    or gRPC, batched export, the sampler of ``OTEL_TRACES_SAMPLER`` (parent-based), under which
    a span marked ``shardserve.batch`` is always recorded (its caller makes one only where a
    member request is sampled). Not the global provider: a global one turns other libraries'
    instrumentation on (FastAPI's among them), which the server does not want on its path."""
    with _lock:
        provider = _providers.get(service)
        if provider is None:
            provider = _providers[service] = _build(service)
        return provider


def _build(service: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    )
    # process.pid: the driver's spans and each stage actor's are told apart by their process.
    base: dict[str, str | int] = {"process.pid": os.getpid()}
    resource = Resource.create(base if named else {**base, "service.name": service})
    sampler: Any = _BatchAware(sampling._get_from_env_or_default())
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    return provider


def _exporter() -> Any:
    protocol, _ = export_target()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter()


class _BatchAware:
    """The configured sampler, except for batch spans (``tracer_provider``) and a canary's
    rollback (rare, and what an operator looks for): those are recorded."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> Any:
        if name == ROLLBACK or (attributes and attributes.get("shardserve.batch")):
            from opentelemetry.sdk.trace.sampling import Decision, SamplingResult

            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"BatchAware{{{self._inner.get_description()}}}"


def context_from(traceparent: str, tracestate: str | None = None) -> Any:
    """The OpenTelemetry context a W3C ``traceparent`` (and ``tracestate``) names."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` of ``span`` (sampled flag included)."""
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


@contextlib.contextmanager
def stage_span(traceparent: str | None, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
    """A span for one stage call, under the batch span ``traceparent`` names, in this process
    (a stage actor's). ``None``, or tracing off here: no span, nothing imported. An error
    leaves the span with its status and the one-line reason (``set_error``), re-raised."""
    if traceparent is None or not wanted():
        yield None
        return
    tracer = tracer_provider().get_tracer("shards")
    with tracer.start_as_current_span(
        name,
        context=context_from(traceparent),
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield span
        except Exception as exc:
            set_error(span, f"{type(exc).__name__}: {_one_line(exc)}")
            raise


def set_error(span: Any, reason: str) -> None:
    """Mark ``span`` failed with a one-line ``reason`` (never a traceback)."""
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, reason))


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""


def flush(timeout_ms: int = 5000) -> None:
    """Export what this process's providers hold (a stop, a test)."""
    for provider in list(_providers.values()):
        provider.force_flush(timeout_ms)
