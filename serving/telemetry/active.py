"""The tracer and the access log this process serves with, ``None`` while off.

Process-wide, as OpenTelemetry's providers and the logging configuration are: the data plane,
the batcher and the HTTP protocol's refusals read them per request, and an attribute read of
``None`` is all that tracing (or the log) costs them while off. The server's lifespan installs
them (``serving.telemetry.setup``) and takes them out when it ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.telemetry.access_log import AccessLog
    from serving.telemetry.traces import Tracer

tracer: Tracer | None = None
access_log: AccessLog | None = None
