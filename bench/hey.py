"""``hey`` as a load generator, with latencies split by status from its ``-o csv`` output.

hey's summary mixes the latencies of every status, and an overloaded server answers most
requests with a fast 503 and the rest with a slow 200: the CSV has the response time and the
status of each request, so both tails can be read apart. Requests that got no answer at all
(timeouts, resets) are left out of hey's CSV; the server's own counters account for them.

hey is a Debian package: ``apt-get install -y hey``. ``-q`` is a per-client rate in hey 0.1.4
and takes a fraction (``-q 1.67``).
"""

from __future__ import annotations

import csv
import io
import math
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HEY_INSTALL_HINT = "install hey with `apt-get update && apt-get install -y hey` (Debian/Ubuntu)"


class HeyError(RuntimeError):
    """hey is missing, failed, or printed no result."""


def have_hey() -> bool:
    return shutil.which("hey") is not None


@dataclass(frozen=True)
class StatusStats:
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    new_connection_share: float  # requests that had to open a connection (hey's DNS+dialup > 0)
    connect_p99_ms: float  # DNS+dialup of those


@dataclass(frozen=True)
class HeyResult:
    clients: int
    rate_per_client: float | None
    seconds: float  # first request sent to last answer received
    statuses: dict[int, StatusStats]

    @property
    def answered(self) -> int:
        return sum(s.count for s in self.statuses.values())

    def count(self, status: int) -> int:
        stats = self.statuses.get(status)
        return stats.count if stats else 0

    def per_s(self, status: int | None = None) -> float:
        """Answers per second with ``status`` (every answer when None)."""
        n = self.answered if status is None else self.count(status)
        return n / self.seconds if self.seconds > 0 else 0.0

    def p99_ms(self, status: int) -> float | None:
        stats = self.statuses.get(status)
        return stats.p99_ms if stats else None

    def to_json(self) -> dict[str, Any]:
        return {
            "clients": self.clients,
            "rate_per_client": self.rate_per_client,
            "seconds": self.seconds,
            "statuses": {str(k): v.__dict__ for k, v in sorted(self.statuses.items())},
        }


def run_hey(
    url: str,
    body: bytes,
    clients: int,
    seconds: float,
    *,
    rate_per_client: float | None = None,
    timeout_s: float = 20.0,
    keep_csv: Path | None = None,
) -> HeyResult:
    """``clients`` workers POST ``body`` for ``seconds``; each at most ``rate_per_client``/s.

    ``keep_csv``: where to keep hey's per-request CSV (for a look at one request's parts)."""
    if not have_hey():
        raise HeyError(f"hey not found on PATH; {HEY_INSTALL_HINT}")
    if clients < 1:
        raise ValueError(f"clients must be >= 1, got {clients}")
    if rate_per_client is not None and rate_per_client <= 0:
        raise ValueError(f"rate_per_client must be > 0 requests/s, got {rate_per_client}")
    with tempfile.TemporaryDirectory(prefix="bench-hey-") as tmp:
        body_file = Path(tmp) / "body.json"
        body_file.write_bytes(body)
        out_file = Path(tmp) / "out.csv"
        argv = ["hey", "-c", str(clients), "-z", f"{max(1, round(seconds))}s"]
        if rate_per_client is not None:
            argv += ["-q", f"{rate_per_client:g}"]
        argv += ["-t", f"{max(1, round(timeout_s))}", "-m", "POST", "-T", "application/json"]
        argv += ["-D", str(body_file), "-o", "csv", url]
        with out_file.open("wb") as sink:
            # hey stops sending at -z, then waits for the answers still out (at most -t).
            proc = subprocess.run(
                argv, stdout=sink, stderr=subprocess.PIPE, timeout=seconds + timeout_s + 60
            )
        text = out_file.read_text(errors="replace")
    if keep_csv is not None:
        keep_csv.parent.mkdir(parents=True, exist_ok=True)
        keep_csv.write_text(text)
    if proc.returncode != 0:
        raise HeyError(f"hey failed (exit {proc.returncode}): {proc.stderr.decode()[-800:]}")
    return parse_csv(text, clients, rate_per_client)


def parse_csv(text: str, clients: int, rate_per_client: float | None = None) -> HeyResult:
    """hey's ``-o csv``: response-time (s), ..., status-code, offset (s since the start)."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header or "status-code" not in header or "response-time" not in header:
        raise HeyError(f"hey printed no CSV result: {text[:300]!r}")
    col_time, col_status = header.index("response-time"), header.index("status-code")
    col_offset, col_dial = header.index("offset"), header.index("DNS+dialup")
    by_status: dict[int, list[tuple[float, float]]] = {}
    first, last = math.inf, 0.0
    for row in reader:
        if len(row) != len(header):
            continue
        took, offset = float(row[col_time]), float(row[col_offset])
        by_status.setdefault(int(row[col_status]), []).append((took, float(row[col_dial])))
        first, last = min(first, offset), max(last, offset + took)
    statuses = {}
    for status, pairs in by_status.items():
        ms = np.asarray(pairs) * 1000.0
        p50, p99 = (float(v) for v in np.percentile(ms[:, 0], [50, 99]))
        dials = ms[ms[:, 1] > 0, 1]
        connect_p99 = float(np.percentile(dials, 99)) if len(dials) else 0.0
        share = len(dials) / len(ms)
        statuses[status] = StatusStats(len(ms), p50, p99, float(ms[:, 0].max()), share, connect_p99)
    seconds = last - first if by_status else 0.0
    return HeyResult(clients, rate_per_client, seconds, statuses)
