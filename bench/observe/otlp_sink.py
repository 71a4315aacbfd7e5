"""An OTLP/HTTP endpoint that accepts every export and drops it: what a traced server sends its
spans to while a bench measures what tracing costs the server, not what a collector costs.

It answers each ``POST`` with 200 and an empty ``ExportTraceServiceResponse`` (an empty body is
one), counting the posts and their bytes, so that a run can say the server did export. It runs
on a thread of the bench's own process: its CPU is the bench's, never the server's.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["OtlpSink"]


class OtlpSink:
    """``with OtlpSink() as sink:`` serves on 127.0.0.1 at ``sink.endpoint`` (the base URL,
    ``OTEL_EXPORTER_OTLP_ENDPOINT``'s value) until the block ends."""

    def __init__(self) -> None:
        self.posts = 0
        self.bytes = 0
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # the exporter keeps its connection

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                with sink._lock:
                    sink.posts += 1
                    sink.bytes += length
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-sink", daemon=True
        )

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
