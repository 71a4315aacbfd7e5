"""The sweep behind ``shardserve tune``: load levels x batch sizes x timeouts, a Locust run each.

For each point the tuner sets the policy through ``PUT /admin/batching``, runs Locust headless
in a subprocess (Locust monkey-patches the process with gevent, so it never runs in this one)
with a warm-up that is excluded from the figures, and reads the JSON summary the locustfile
writes. The output files are rewritten after every point, so an interrupted sweep keeps what it
measured. The server's original policy is put back at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.bodies import PROTOCOLS
from loadtest.choice import AUTO, Point
from loadtest.report import write_all

__all__ = [
    "Load",
    "TuneConfig",
    "parse_loads",
    "parse_protocol",
    "parse_sizes",
    "parse_timeouts",
    "run_sweep",
]

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
_RPS_PER_USER = 10.0  # open loop: enough users that each paces itself at most this fast


@dataclass(frozen=True)
class Load:
    """A load level: ``users`` closed-loop clients, or paced to ``target_rps`` in total."""

    label: str
    users: int
    target_rps: float = 0.0


@dataclass
class TuneConfig:
    url: str
    timeouts: list[str]
    loads: list[Load]
    duration_s: float
    out: Path
    slo_p99_ms: float | None = None
    max_batch_sizes: list[int | None] = field(default_factory=lambda: [None])
    warmup_s: float = 3.0
    rows: int = 1
    admin_token: str | None = None
    model_name: str = ""
    repeats: int = 1  # runs per point; the report gives their medians
    protocol: str = "tfserving"  # tfserving | v2-json | v2-binary (the locustfile's PROTOCOLS)


def parse_timeouts(text: str) -> list[str]:
    """``"0,2.5,auto"`` -> ``["0", "2.5", "auto"]``; each a number of ms >= 0 or ``auto``."""
    timeouts = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        if part == AUTO:
            timeouts.append(AUTO)
            continue
        try:
            ms = float(part)
        except ValueError:
            ms = -1.0
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"--timeouts wants ms >= 0 or 'auto', comma-separated; got {part!r}")
        timeouts.append(f"{ms:g}")
    if not timeouts:
        raise ValueError(f"--timeouts needs at least one value, got {text!r}")
    return list(dict.fromkeys(timeouts))


def parse_loads(text: str) -> list[Load]:
    """``"4,16"`` closed-loop user counts; ``"200rps"`` an open-loop request rate."""
    loads = []
    for part in filter(None, (p.strip().lower() for p in text.split(","))):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)(rps|/s)?", part)
        value = float(match.group(1)) if match else 0.0
        if not match or value <= 0 or (not match.group(2) and not value.is_integer()):
            raise ValueError(
                f"--loads wants user counts (16) or request rates (200rps), got {part!r}"
            )
        if match.group(2):
            users = max(4, math.ceil(value / _RPS_PER_USER))
            loads.append(Load(f"{value:g}rps", users, value))
        else:
            loads.append(Load(f"c={int(value)}", int(value)))
    if not loads:
        raise ValueError(f"--loads needs at least one value, got {text!r}")
    return loads


def parse_protocol(text: str) -> str:
    if text not in PROTOCOLS:
        raise ValueError(f"--protocol must be one of {', '.join(PROTOCOLS)}; got {text!r}")
    return text


def parse_sizes(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    sizes: list[int | None] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--max-batch-sizes wants integers >= 1, got {part!r}")
        sizes.append(int(part))
    return sizes or [None]


class Admin:
    """The server's admin route and metrics, through one HTTP client."""

    def __init__(self, url: str, token: str | None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=30)

    def batching(self) -> dict[str, Any]:
        return self._check(self.client.get("/admin/batching"))

    def set_batching(self, **changes: Any) -> dict[str, Any]:
        return self._check(self.client.put("/admin/batching", json=changes))

    def batch_rows(self) -> tuple[float, float]:
        """(sum, count) of the batch-size histogram, to get the mean batch of a window."""
        text = self.client.get("/metrics").text
        values = {}
        for name in ("shardserve_batch_size_rows_sum", "shardserve_batch_size_rows_count"):
            # Summed over the served versions' series (labels model, version).
            found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
            values[name] = sum(float(v) for v in found)
        return values["shardserve_batch_size_rows_sum"], values["shardserve_batch_size_rows_count"]

    def _check(self, response: httpx.Response) -> dict[str, Any]:
        if response.status_code != 200:
            try:
                error = response.json().get("error", response.text)
            except ValueError:
                error = response.text
            hint = " (pass --admin-token)" if response.status_code in (401, 403, 404) else ""
            raise RuntimeError(
                f"{response.request.method} {response.request.url} answered "
                f"{response.status_code}: {error}{hint}"
            )
        data: dict[str, Any] = response.json()
        return data

    def close(self) -> None:
        self.client.close()


def run_locust(config: TuneConfig, load: Load, summary_path: Path) -> dict[str, Any]:
    """One headless Locust run; the figures of its measured window (warm-up excluded)."""
    run_s = math.ceil(config.warmup_s + config.duration_s)
    command = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
        "--host", config.url, "-u", str(load.users), "-r", str(load.users), "-t", f"{run_s}s",
        "--only-summary", "--loglevel", "WARNING", "--rows", str(config.rows),
        "--warmup-s", str(config.warmup_s), "--summary-json", str(summary_path),
        "--protocol", config.protocol,
    ]  # fmt: skip
    if load.target_rps:
        command += ["--target-rps", str(load.target_rps)]
    if config.model_name:
        command += ["--model-name", config.model_name]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=run_s + 120, env=env, check=False
    )
    if done.returncode not in (0, 1) or not summary_path.exists():  # 1: some requests failed
        tail = (done.stderr or done.stdout)[-2000:]
        raise RuntimeError(f"locust exited with {done.returncode} and no summary:\n{tail}")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    return summary


def measure(config: TuneConfig, admin: Admin, load: Load, timeout: str, size: int | None) -> Point:
    changes: dict[str, Any] = {"batch_timeout_ms": AUTO if timeout == AUTO else float(timeout)}
    if size is not None:
        changes["max_batch_size"] = size
    admin.set_batching(**changes)
    before = admin.batch_rows()
    with tempfile.TemporaryDirectory(prefix="shardserve-tune-") as tmp:
        summary = run_locust(config, load, Path(tmp) / "summary.json")
    after = admin.batch_rows()
    batches = after[1] - before[1]
    return Point(
        load=load.label,
        timeout=timeout,
        max_batch_size=size,
        requests=int(summary["requests"]),
        failures=int(summary["failures"]),
        rps=float(summary["rps"]),
        p50_ms=float(summary["p50_ms"]),
        p95_ms=float(summary["p95_ms"]),
        p99_ms=float(summary["p99_ms"]),
        # Includes the warm-up's batches: the metric cannot be reset from here.
        mean_batch=(after[0] - before[0]) / batches if batches > 0 else None,
    )


def run_sweep(
    config: TuneConfig,
    *,
    on_point: Callable[[Point, int, int], None] | None = None,
    header: str = "",
) -> tuple[list[Point], bool]:
    """Measure every run; return them and whether the sweep finished (False: interrupted).

    Repeats go round the timeouts (0, 5, auto, 0, 5, auto, ...) rather than back to back, so a
    slow drift of the machine touches every setting alike.
    """
    admin = Admin(config.url, config.admin_token)
    points: list[Point] = []
    plan = [
        (load, size, timeout)
        for load in config.loads
        for size in config.max_batch_sizes
        for _ in range(config.repeats)
        for timeout in config.timeouts
    ]
    original = admin.batching()
    finished = False
    try:
        for load, size, timeout in plan:
            point = measure(config, admin, load, timeout, size)
            points.append(point)
            write_all(points, config.slo_p99_ms, config.out, header=header)
            if on_point is not None:
                on_point(point, len(points), len(plan))
        finished = True
    except KeyboardInterrupt:
        pass  # keep what was measured; the files already hold it
    finally:
        # The server may be gone; then the sweep's own error says more than this one would.
        with contextlib.suppress(RuntimeError, httpx.HTTPError):
            admin.set_batching(
                batch_timeout_ms=original["batch_timeout_ms"],
                max_batch_size=original["max_batch_size"],
            )
        admin.close()
    return points, finished


def sweep_header(config: TuneConfig) -> str:
    loads = ", ".join(
        f"{ld.label} ({ld.users} users{', open loop' if ld.target_rps else ''})"
        for ld in config.loads
    )
    return (
        f"Server {config.url}, {time.strftime('%Y-%m-%d %H:%M')}. Loads: {loads}; "
        f"{config.rows} row(s) per request; {config.duration_s:g} s measured per point after "
        f"{config.warmup_s:g} s of warm-up"
        + (f"; medians of {config.repeats} runs, interleaved." if config.repeats > 1 else ".")
    )


def tune(config: TuneConfig) -> int:
    """Run the sweep with a progress bar; print the winners; 0 when finished, 130 interrupted."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from loadtest.choice import choose, medians, recommend

    console = Console(stderr=True)
    total = len(config.loads) * len(config.max_batch_sizes) * len(config.timeouts) * config.repeats
    columns = (
        "{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        bar = progress.add_task("sweeping", total=total)

        def on_point(point: Point, done: int, _: int) -> None:
            progress.update(bar, advance=1)
            progress.console.print(
                f"load {point.load:>8}  {point.label:>16}: {point.rps:8.1f} req/s  "
                f"p99 {point.p99_ms:6.0f} ms  failures {point.failures}/{point.requests}",
                highlight=False,
            )

        points, finished = run_sweep(config, on_point=on_point, header=sweep_header(config))
    if not points:
        console.print("[red]interrupted before any point was measured[/red]")
        return 130
    points = medians(points)
    for choice in choose(points, config.slo_p99_ms):
        console.print(f"load {choice.load}: [bold]{choice.winner.label}[/bold] ({choice.note})")
    console.print(f"recommended: {recommend(points, config.slo_p99_ms)[1]}", highlight=False)
    if not finished:
        console.print(f"[yellow]interrupted: kept {len(points)} of {total} runs[/yellow]")
    console.print(
        f"wrote {config.out}/results.csv, runs.csv, report.md, latency_throughput.png, "
        "recommended.toml",
        highlight=False,
    )
    return 0 if finished else 130
