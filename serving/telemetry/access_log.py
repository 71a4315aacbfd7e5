"""The access log: one structured line per request, for every protocol, refusals included.

``--access-log json`` (one JSON object a line, for log pipelines) or ``text`` (``key=value``
pairs, for people); ``off`` by default (uvicorn's own access log stays off: it sees neither
gRPC nor the refusals answered inside the HTTP protocol). Written to the ``shardserve.access``
logger, which prints the line alone on stdout and does not pass it to the server's log.
Never the body, never an error's detail beyond the one-line reason the client got.

    time        when the answer went (ISO 8601, UTC, ms)
    request_id  the X-Request-Id (the client's, else the server's)
    trace_id    the request's trace (where it is sampled), else ""
    client      the peer's address
    route       the HTTP path, or the gRPC method
    protocol    http or grpc
    model, version
    status      the HTTP status (gRPC: the HTTP status of its outcome, as the metrics count it)
    rows        rows the request held; batch_rows: rows of the batch it rode in
    queue_ms, compute_ms, total_ms    as in Server-Timing
    bytes_in, bytes_out               the bodies' (messages') sizes
    reject      why it was refused or failed (queue_full, too_large, invalid_input, ...), or ""
    tokens      a generation's tokens answered (0: none, or not a generation)
    ttft_ms     a generation's time to its first token (from the request's start; 0: none)
    finish      how a generation ended: its finish reason (length, stop; done: its choices'
                differ), or what cut it short (cancelled, deadline, error: a stream's failure
                after its first token, its status 200 sent already); "" where not one

The routes outside the data plane (probes, ``/metrics``, admin, 404s) get their lines from
``serving.http.access``.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Literal

import orjson

if TYPE_CHECKING:
    from serving.telemetry.stamp import Stamp

__all__ = ["FIELDS", "AccessLog", "reject_reason", "status_reason"]

FIELDS = (
    "time", "request_id", "trace_id", "client", "route", "protocol", "model", "version",
    "status", "rows", "batch_rows", "queue_ms", "compute_ms", "total_ms", "bytes_in",
    "bytes_out", "reject", "tokens", "ttft_ms", "finish",
)  # fmt: skip

# An error's class (its name: no import of serving.errors here) -> the log's reject reason.
_REASONS = {
    "QueueFullError": "queue_full",
    "PayloadTooLargeError": "too_large",
    "InvalidInputError": "invalid_input",
    "ModelInputError": "model_input",
    "DeadlineExceededError": "deadline",
    "NotFoundError": "not_found",
    "NotReadyError": "not_ready",
    "RecoveringError": "not_ready",
    "BatchFailedError": "batch_failed",
    "UnauthorizedError": "unauthorized",
    "ForbiddenError": "forbidden",
}


# A route's answer outside the data plane (``serving.http.access``): its status is all there is.
_STATUS_REASONS = {
    400: "invalid_input",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    422: "invalid_input",
    503: "not_ready",
    504: "deadline",
}


def status_reason(status: int) -> str:
    """The ``reject`` of an answer known by its status alone (a route's, not an inference's)."""
    if status < 400:
        return ""
    return _STATUS_REASONS.get(status, "internal" if status >= 500 else "refused")


def reject_reason(error: BaseException | None, status: int) -> str:
    """The access log's ``reject`` for a request that ended with ``error`` and ``status``."""
    if status < 400:
        return ""
    if error is None:
        return "client_gone" if status == 499 else "internal"
    for cls in type(error).__mro__:
        reason = _REASONS.get(cls.__name__)
        if reason is not None:
            return reason
    return "internal"


class _Stdout(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stdout`` of each line's moment, not of the handler's making: a process
    that swaps its stdout (a test runner capturing it, a daemon redirecting it) must not leave
    the log writing to a stream that was closed since."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


class AccessLog:
    """Writes the lines in one ``form``; ``stream``: where (stdout by default); ``probes``:
    whether a probe or a metrics scrape that answered 2xx gets its line too
    (``serving.http.access``)."""

    def __init__(
        self, form: Literal["json", "text"], stream: Any = None, *, probes: bool = False
    ) -> None:
        self.form = form
        self.probes = probes
        self._log = logging.getLogger("shardserve.access")
        self._log.propagate = False
        self._log.setLevel(logging.INFO)
        self._handler = logging.StreamHandler(stream) if stream is not None else _Stdout()
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._log.addHandler(self._handler)

    def close(self) -> None:
        self._log.removeHandler(self._handler)

    def line(
        self,
        stamp: Stamp,
        *,
        request_id: str,
        client: str,
        route: str,
        protocol: str,
        reject: str,
        model: str = "",
        version: str = "",
        bytes_in: int = 0,
        total_ms: float | None = None,
    ) -> None:
        """One request's line, its status, rows, times, bytes out and tokens read off its
        ``stamp``: the one way an answer is logged, the data plane's, a refusal's before it
        (``serving.protocols.dataplane.refused``, the HTTP protocol's) and a route's
        (``serving.http.access``) alike. ``total_ms``: the total its answer's ``Server-Timing``
        said, where that was written before the line (a refusal's), else the stamp's till now."""
        self.write(
            request_id=request_id, trace_id=stamp.trace_id, client=client, route=route,
            protocol=protocol, model=model, version=version, status=stamp.status,
            rows=stamp.rows, batch_rows=stamp.batch_rows, queue_ms=stamp.queue_ms,
            compute_ms=stamp.compute_ms,
            total_ms=stamp.total_ms() if total_ms is None else total_ms, bytes_in=bytes_in,
            bytes_out=stamp.bytes_out, reject=reject, tokens=stamp.tokens,
            ttft_ms=stamp.first_token_ms, finish=stamp.finish,
        )  # fmt: skip

    def write(
        self,
        *,
        request_id: str,
        trace_id: str | None,
        client: str,
        route: str,
        protocol: str,
        model: str,
        version: str,
        status: int,
        rows: int,
        batch_rows: int,
        queue_ms: float,
        compute_ms: float,
        total_ms: float,
        bytes_in: int,
        bytes_out: int,
        reject: str,
        tokens: int = 0,
        ttft_ms: float = 0.0,
        finish: str = "",
    ) -> None:
        now = time.time()
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        stamp = f"{when}.{int(now % 1 * 1000):03d}Z"
        values = (
            stamp, request_id, trace_id or "", client, route, protocol, model, version, status,
            rows, batch_rows, round(queue_ms, 3), round(compute_ms, 3), round(total_ms, 3),
            bytes_in, bytes_out, reject, tokens, round(ttft_ms, 3), finish,
        )  # fmt: skip
        if self.form == "json":
            line = orjson.dumps(dict(zip(FIELDS, values, strict=True))).decode()
        else:
            line = " ".join(f"{k}={_text(v)}" for k, v in zip(FIELDS, values, strict=True))
        self._log.info(line)


# What a text value may not hold bare: a space or a quote (it would split or end the pair), a
# backslash (an escape), a control character (a newline writes a line of the client's making:
# uvicorn's path is percent-decoded, so "%0A" in a URL is one), and the characters that
# other tools read as a line break (NEL, U+2028, U+2029).
_UNSAFE = re.compile(r'[\x00-\x20"\\\x7f-\x9f\u2028\u2029]')
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", '"': '\\"', "\\": "\\\\", " ": " "}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    escaped = _ESCAPES.get(char)
    if escaped is not None:
        return escaped
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _text(value: object) -> str:
    """``value`` bare where it is safe, else quoted, its unsafe characters escaped as in a JSON
    string (a newline as backslash-n; other controls as backslash-xNN): one line per request,
    whatever a client put in its path or headers."""
    text = str(value)
    if not text:
        return "-"
    if _UNSAFE.search(text) is None:
        return text
    return f'"{_UNSAFE.sub(_escape, text)}"'
