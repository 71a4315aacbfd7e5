"""Load from outside the servers' processes: ``wrk`` (closed loop), or the Python generator.

``wrk`` is a Debian package (``apt-get install -y wrk``); it POSTs the same body (any bytes, and
any headers: the V2 binary tensor extension's ``Inference-Header-Content-Length``) on every
connection and reports latency percentiles through a Lua ``done`` hook. Open loop (a fixed rate,
latency measured from each request's scheduled start) and the fallback when ``wrk`` is missing
run ``bench.load.pyload`` in a subprocess. Every system gets the same generator in one run, so the
ratios are fair even though the generator competes with the servers for the CPU.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import orjson

from bench.load import pyload
from bench.load.result import LoadError, LoadResult

WRK_INSTALL_HINT = "install wrk with `apt-get install -y wrk` (Debian/Ubuntu)"

_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = assert(io.open(os.getenv("BENCH_BODY_FILE"), "rb"))
wrk.body = f:read("*a")
f:close()
for line in (os.getenv("BENCH_HEADERS") or ""):gmatch("[^\\n]+") do
  local name, value = line:match("^([^:]+):%s*(.*)$")
  if name then wrk.headers[name] = value end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH_JSON {"requests":%d,"duration_us":%d,"errors":%d,"non2xx":%d,'
    .. '"p50_us":%.1f,"p90_us":%.1f,"p99_us":%.1f,"mean_us":%.1f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.mean))
end
"""


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def closed_loop(
    url: str,
    body: bytes,
    concurrency: int,
    seconds: float,
    *,
    tool: str = "auto",
    headers: Mapping[str, str] | None = None,
) -> LoadResult:
    """``concurrency`` clients, each sending its next request when the last one answered.

    ``headers`` (wrk only) are added to or replace the default ``Content-Type: application/json``.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if tool == "auto":
        tool = "wrk" if have_wrk() else "python"
    if tool == "wrk":
        if not have_wrk():
            raise LoadError(f"wrk not found on PATH; {WRK_INSTALL_HINT}")
        return _wrk(url, body, concurrency, seconds, headers or {})
    if tool != "python":
        raise ValueError(f"load tool must be 'wrk', 'python' or 'auto', got {tool!r}")
    if headers:
        raise LoadError(f"requests with headers of their own are sent by wrk; {WRK_INSTALL_HINT}")
    return pyload.run(url, body, ["--concurrency", str(concurrency)], seconds)


def open_loop(
    url: str, body: bytes, rate: float, seconds: float, *, poisson: bool = False, skip_s: float = 0
) -> LoadResult:
    """Requests start at a fixed rate (or Poisson arrivals of that mean rate) whatever the answers
    do (no coordinated omission); the first ``skip_s`` seconds are a warm-up, not counted."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    extra = ["--poisson"] if poisson else []
    if skip_s:
        extra += ["--skip", f"{skip_s:g}"]
    return pyload.run(url, body, ["--rate", f"{rate:g}", *extra], seconds)


def _wrk(
    url: str, body: bytes, concurrency: int, seconds: float, headers: Mapping[str, str]
) -> LoadResult:
    threads = min(2, concurrency)
    with tempfile.TemporaryDirectory(prefix="bench-wrk-") as tmp:
        script = Path(tmp) / "post.lua"
        body_file = Path(tmp) / "body"
        script.write_text(_WRK_SCRIPT)
        body_file.write_bytes(body)
        argv = ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, round(seconds))}s"]
        argv += ["--timeout", "30s", "-s", str(script), url]
        for name, value in headers.items():
            if not name or ":" in name or "\n" in name + value:
                raise ValueError(f"header {name!r}: {value!r} cannot be sent as one line")
        env = {
            "BENCH_BODY_FILE": str(body_file),
            "BENCH_HEADERS": "\n".join(f"{k}: {v}" for k, v in headers.items()),
        }
        proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if proc.returncode != 0 or line is None:
        raise LoadError(f"wrk failed (exit {proc.returncode}): {proc.stdout[-800:]}{proc.stderr}")
    raw = orjson.loads(line.removeprefix("BENCH_JSON "))
    secs = raw["duration_us"] / 1e6
    ok = raw["requests"] - raw["non2xx"]
    return LoadResult(
        mode="closed",
        concurrency=concurrency,
        rate=None,
        requests=raw["requests"],
        seconds=secs,
        rps=ok / secs if secs else 0.0,
        p50_ms=raw["p50_us"] / 1000,
        p90_ms=raw["p90_us"] / 1000,
        p99_ms=raw["p99_us"] / 1000,
        errors=raw["errors"] + raw["non2xx"],
        tool="wrk",
    )
