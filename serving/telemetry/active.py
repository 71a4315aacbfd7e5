"""The tracer and the access log this process serves with, ``None`` while off.

Process-wide, as OpenTelemetry's providers and the logging configuration are: the data plane,
the batcher and the HTTP protocol's refusals read them per request, and an attribute read of
``None`` is all that tracing (or the log) costs them while off. The server's lifespan installs
them (``serving.telemetry.setup``) and takes them out when it ends. ``Tracer`` is what they call
of ``serving.telemetry.traces.Tracer``, named here so that naming it imports no OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from serving.telemetry.access_log import AccessLog
    from serving.telemetry.stamp import Segment, Stamp

__all__ = ["Tracer", "access_log", "tracer"]

Attributes = dict[str, str | int | float | bool]


class Tracer(Protocol):
    """The spans of a request, a generated sequence, a batch and a canary's rollback
    (``serving.telemetry.traces.Tracer``)."""

    def request(self, stamp: Stamp, traceparent: str | None, tracestate: str | None) -> None: ...

    def request_end(self, stamp: Stamp, attributes: Attributes, failed: str | None) -> None: ...

    def sequence(
        self,
        stamp: Stamp,
        *,
        arrived: float,
        admitted: float | None,
        first_token: float | None,
        ended: float,
        attributes: Attributes,
        failed: bool,
    ) -> None: ...

    def batch(self, segments: Sequence[Segment], attributes: Attributes) -> Any: ...

    def batch_end(self, span: Any, clean: bool, isolated: int) -> None: ...

    def batch_failed(self, message: str, rows: int, splitting: bool) -> None: ...

    def rerun(self, segments: Sequence[Segment]) -> AbstractContextManager[None]: ...

    def rollback(self, model: str, canary: str, stable: str, reason: str, detail: str) -> None: ...


tracer: Tracer | None = None
access_log: AccessLog | None = None
