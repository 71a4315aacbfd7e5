"""The access-log line of an answer the app gives outside the data plane: the health and
readiness probes, ``/metrics``, the admin and repository routes, metadata, 404s.

They belong in the log that says "one line per request": an admin's ``PUT`` or ``rollback`` is
a change someone made to the server (the log is its audit trail), a 404 is a client calling a
model or a route that is not there, a failed readiness probe is why the orchestrator took the
server out. A probe or a scrape that answers 2xx says nothing the metrics do not, and comes
every few seconds from each kubelet and Prometheus: those lines are left out unless
``access_log_probes`` is on (``AccessLog.probes``); a probe that fails is always logged.

The inference routes are logged by the data plane (``serving.protocols.dataplane``), with their
times and rows; here the fields a route has: its status, its total time, the bytes out and the
``Content-Length`` in (the body is not read for the log), the request id; ``model`` and
``version`` stay empty (the path names them). Nothing of this runs while the log is off.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.types import Message, Scope, Send

from serving.http.admission import declared_length
from serving.http.replies import REQUEST_ID_KEY
from serving.telemetry.access_log import status_reason
from serving.telemetry.headers import client_address
from serving.telemetry.stamp import Stamp

if TYPE_CHECKING:
    from serving.telemetry.access_log import AccessLog

__all__ = ["RouteLine", "is_probe"]

_PROBES = frozenset({"/healthz", "/readyz", "/metrics", "/v2/health/live", "/v2/health/ready"})


def is_probe(path: str) -> bool:
    """A health or readiness probe, or the metrics scrape (V2's model readiness included)."""
    return path in _PROBES or (path.startswith("/v2/models/") and path.endswith("/ready"))


class RouteLine:
    """One request's line: ``send`` watches the answer go (its status, its bytes), ``write``
    writes the line once the app is done (a 500 where it raised before answering)."""

    __slots__ = ("_access", "_scope", "_send", "_started", "bytes_out", "status")

    def __init__(self, scope: Scope, send: Send, access: AccessLog) -> None:
        self._scope = scope
        self._send = send
        self._access = access
        self._started = time.perf_counter()
        self.status = 0
        self.bytes_out = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.bytes_out += len(message.get("body", b""))
        await self._send(message)

    def write(self) -> None:
        scope, status = self._scope, self.status or 500
        path: str = scope.get("path", "")
        if status < 300 and not self._access.probes and is_probe(path):
            return
        rid: bytes = scope.get(REQUEST_ID_KEY, b"")
        stamp = Stamp(self._started)
        stamp.status, stamp.bytes_out = status, self.bytes_out
        self._access.line(
            stamp, request_id=rid.decode("latin-1"), client=client_address(scope), route=path,
            protocol="http", reject=status_reason(status), bytes_in=_content_length(scope),
        )  # fmt: skip


def _content_length(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return max(declared_length(value) or 0, 0)
    return 0
