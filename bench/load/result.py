"""What every load generator reports, one JSON line when it runs as a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import orjson

from bench.systems.base import subprocess_env


@dataclass(frozen=True)
class LoadResult:
    mode: str  # "closed" | "open"
    concurrency: int
    rate: float | None
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    tool: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def print_line(self) -> None:
        """The result as the one line a generator started as a child prints last."""
        sys.stdout.write(orjson.dumps(asdict(self)).decode() + "\n")


class LoadError(RuntimeError):
    """The load generator failed or printed no result."""


def from_latencies(
    mode: str,
    concurrency: int,
    rate: float | None,
    latencies_s: list[float],
    errors: int,
    seconds: float,
    tool: str,
) -> LoadResult:
    """Percentiles of the requests' latencies; req/s counts the answers that were not errors."""
    ms = np.asarray(latencies_s) * 1000 if latencies_s else np.zeros(1)
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))
    return LoadResult(
        mode=mode,
        concurrency=concurrency,
        rate=rate,
        requests=len(latencies_s),
        seconds=seconds,
        rps=(len(latencies_s) - errors) / seconds if seconds else 0.0,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        errors=errors,
        tool=tool,
    )


def run_child(module: str, args: list[str], timeout_s: float | None = None) -> LoadResult:
    """``python -m module args``: the generator as a process of its own, and its result line."""
    return wait_child(start_child(module, args), timeout_s)


def start_child(module: str, args: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", module, *args]
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env()
    )


def wait_child(proc: subprocess.Popen[bytes], timeout_s: float | None = None) -> LoadResult:
    """The result line of a generator started by ``start_child``; killed if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0 or not out.strip():
        # argv is [python, -m, module, ...]
        module = os.fsdecode(proc.args[2]) if isinstance(proc.args, list) else "a load generator"
        raise LoadError(f"{module} failed (exit {proc.returncode}): {err.decode()[-800:]}")
    return LoadResult(**orjson.loads(out.strip().splitlines()[-1]))
