"""Turning tracing and the access log on at the server's start, and off at its end.

Tracing is on where the settings say so (``tracing``, ``otlp_endpoint``: a flag or the TOML
file), else where an OTLP endpoint variable is set, as for any OpenTelemetry-instrumented
service; ``OTEL_SDK_DISABLED=true`` wins over both. An ``otlp_endpoint`` setting is written
into this process's environment as ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` before Ray starts,
so that the stage actors (which inherit it, or get it through ``runtime_env``:
``shards.cluster``) export where the server does. The server says at start whether tracing is
on and where it exports (the endpoint without a user, password or query: they may be
credentials). Nothing of OpenTelemetry is imported while tracing is off; on without the
``tracing`` extra installed, the start fails in one line that names the extra (``check``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from serving.settings.sources import ConfigError
from serving.telemetry import active
from shards import tracing

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = ["check", "shown_endpoint", "start", "stop", "tracing_on"]

log = logging.getLogger("shardserve")
_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
_DISABLED = "OTEL_SDK_DISABLED"


def tracing_on(settings: Settings) -> bool:
    """Whether the server exports traces: see the module's docstring for the rule."""
    if os.environ.get(_DISABLED, "").strip().lower() == "true":
        return False
    if settings.tracing is not None:
        return settings.tracing
    return settings.otlp_endpoint is not None or tracing.wanted()


def check(settings: Settings) -> None:
    """A one-line ``ConfigError`` where tracing is on and OpenTelemetry is not installed."""
    if not tracing_on(settings):
        return
    missing = tracing.missing_package()
    if missing is None:
        return
    if settings.tracing:
        why = "tracing = true"
    elif settings.otlp_endpoint is not None:
        why = "otlp_endpoint is set"
    else:
        why = "an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable is set"
    raise ConfigError(
        f"tracing is on ({why}) but {missing} is not installed: pip install "
        "'shardserve[tracing]', or turn tracing off (OTEL_SDK_DISABLED=true)"
    )


def shown_endpoint(endpoint: str) -> str:
    """``endpoint`` for the log: no user, password, query or fragment (tokens go there)."""
    try:
        parts = urlsplit(endpoint)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port is not None else ""
    except ValueError:
        return "(an endpoint that is not a URL)"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return urlunsplit((parts.scheme, host + port, parts.path, "", ""))


def start(settings: Settings) -> None:
    """Install the tracer and the access log the settings ask for (``serving.telemetry.active``)."""
    check(settings)
    if settings.access_log != "off" and active.access_log is None:
        from serving.telemetry.access_log import AccessLog

        active.access_log = AccessLog(settings.access_log, probes=settings.access_log_probes)
    if not tracing_on(settings):
        if settings.tracing or settings.otlp_endpoint:
            log.info("tracing: off (%s=true)", _DISABLED)
        else:
            log.info("tracing: off (set OTEL_EXPORTER_OTLP_ENDPOINT or --otlp-endpoint)")
        return
    if settings.otlp_endpoint is not None:
        os.environ[_ENDPOINT] = settings.otlp_endpoint
    elif not tracing.wanted():  # --tracing alone: the OTLP default, on this machine
        protocol, endpoint = tracing.export_target()
        os.environ[_ENDPOINT] = endpoint
    from serving.telemetry.traces import Tracer

    active.tracer = Tracer(client_sampled_per_s=settings.trace_client_sampled_per_s)
    protocol, endpoint = tracing.export_target()
    sampler = os.environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    arg = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
    log.info(
        "tracing: on, exporting OTLP (%s) to %s, sampler %s%s",
        protocol,
        shown_endpoint(endpoint),
        sampler,
        f" ({arg})" if arg else "",
    )


def stop() -> None:
    """Export what is left and take the tracer and the access log out."""
    if active.tracer is not None:
        active.tracer = None
        try:
            tracing.flush()
        except Exception:
            log.warning("exporting the last spans failed", exc_info=True)
    if active.access_log is not None:
        active.access_log.close()
        active.access_log = None
