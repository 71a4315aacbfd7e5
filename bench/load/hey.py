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
import shutil
import subprocess
import tempfile
import time
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
    burst_share: float | None = None  # see _burst_share

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
            "burst_share": self.burst_share,
            "statuses": {str(k): v.__dict__ for k, v in sorted(self.statuses.items())},
        }


def run_hey(
    url: str,
    body: bytes,
    clients: int,
    seconds: float,
    *,
    rate_per_client: float | None = None,
    groups: int = 1,
    timeout_s: float = 20.0,
    keep_csv: Path | None = None,
) -> HeyResult:
    """``clients`` workers POST ``body`` for ``seconds``; each at most ``rate_per_client``/s.

    hey starts every worker's rate ticker at once, so its rate-limited workers send in step: one
    burst of ``clients`` requests per tick. ``groups`` > 1 splits them over that many hey
    processes started evenly over one tick, the same offered rate in smaller bursts.
    ``keep_csv``: where to keep the per-request CSV (for a look at one request's parts)."""
    if not have_hey():
        raise HeyError(f"hey not found on PATH; {HEY_INSTALL_HINT}")
    if clients < groups or groups < 1:
        raise ValueError(f"need 1 <= groups <= clients, got groups={groups}, clients={clients}")
    if rate_per_client is not None and rate_per_client <= 0:
        raise ValueError(f"rate_per_client must be > 0 requests/s, got {rate_per_client}")
    stagger_s = 1.0 / rate_per_client / groups if rate_per_client else 0.0
    with tempfile.TemporaryDirectory(prefix="bench-hey-") as tmp:
        body_file = Path(tmp) / "body.json"
        body_file.write_bytes(body)
        procs = []
        first = time.monotonic()
        for g in range(groups):
            n = clients // groups + (g < clients % groups)
            argv = ["hey", "-c", str(n), "-z", f"{max(1, round(seconds))}s"]
            if rate_per_client is not None:
                argv += ["-q", f"{rate_per_client:g}"]
            argv += ["-t", f"{max(1, round(timeout_s))}", "-m", "POST", "-T", "application/json"]
            argv += ["-D", str(body_file), "-o", "csv", url]
            time.sleep(max(0.0, first + g * stagger_s - time.monotonic()))
            out = Path(tmp) / f"out-{g}.csv"
            with out.open("wb") as sink:
                proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.PIPE)
            procs.append((proc, out, time.monotonic() - first))
        rows: list[tuple[int, float, float, float]] = []
        for proc, out, shift in procs:
            # hey stops sending at -z, then waits for the answers still out (at most -t).
            _, err = proc.communicate(timeout=seconds + timeout_s + 60)
            if proc.returncode != 0:
                raise HeyError(f"hey failed (exit {proc.returncode}): {err.decode()[-800:]}")
            rows += read_csv(out.read_text(errors="replace"), shift)
    if keep_csv is not None:
        keep_csv.parent.mkdir(parents=True, exist_ok=True)
        lines = ["status-code,response-time,DNS+dialup,offset"]
        lines += [f"{st},{took:.4f},{dial:.4f},{start:.4f}" for st, took, dial, start in rows]
        keep_csv.write_text("\n".join(lines) + "\n")
    return summarize(rows, clients, rate_per_client)


Row = tuple[int, float, float, float]  # status, response time s, connect s, start s


def read_csv(text: str, shift_s: float = 0.0) -> list[Row]:
    """hey's ``-o csv`` (response-time, ..., status-code, offset since hey started), with each
    start moved by ``shift_s``."""
    reader = csv.reader(io.StringIO(text))
    header = next(reader, None)
    if not header or "status-code" not in header or "response-time" not in header:
        raise HeyError(f"hey printed no CSV result: {text[:300]!r}")
    col_time, col_status = header.index("response-time"), header.index("status-code")
    col_offset, col_dial = header.index("offset"), header.index("DNS+dialup")
    return [
        (int(r[col_status]), float(r[col_time]), float(r[col_dial]), float(r[col_offset]) + shift_s)
        for r in reader
        if len(r) == len(header)
    ]


def parse_csv(text: str, clients: int, rate_per_client: float | None = None) -> HeyResult:
    return summarize(read_csv(text), clients, rate_per_client)


def summarize(rows: list[Row], clients: int, rate_per_client: float | None) -> HeyResult:
    by_status: dict[int, list[tuple[float, float]]] = {}
    for status, took, dial, _ in rows:
        by_status.setdefault(status, []).append((took, dial))
    statuses = {}
    for status, pairs in by_status.items():
        ms = np.asarray(pairs) * 1000.0
        p50, p99 = (float(v) for v in np.percentile(ms[:, 0], [50, 99]))
        dials = ms[ms[:, 1] > 0, 1]
        connect_p99 = float(np.percentile(dials, 99)) if len(dials) else 0.0
        share = len(dials) / len(ms)
        statuses[status] = StatusStats(len(ms), p50, p99, float(ms[:, 0].max()), share, connect_p99)
    seconds = max(s + t for _, t, _, s in rows) - min(s for *_, s in rows) if rows else 0.0
    return HeyResult(
        clients, rate_per_client, seconds, statuses, _burst_share(rows, rate_per_client)
    )


def _burst_share(rows: list[Row], rate_per_client: float | None) -> float | None:
    """The share of requests sent in the busiest tenth of the rate ticker's period: 0.1 when
    they are spread evenly, near 1 when every client sends on the same tick."""
    if not rate_per_client or not rows:
        return None
    period = 1.0 / rate_per_client
    phases = np.mod([start for *_, start in rows], period) / period
    counts, _ = np.histogram(phases, bins=10, range=(0.0, 1.0))
    return float(counts.max() / len(rows))
