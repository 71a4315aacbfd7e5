"""A small real sweep: ``shardserve tune`` against a real demo-tiny server on the session's Ray."""

from __future__ import annotations

import csv
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serverproc import ray_env, running_server

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOKEN = "tune-test-token"


@pytest.fixture
def server(ray_address: str, demo_cache: Path, tmp_path: Path) -> Iterator[str]:
    args = [
        "--model", "demo-tiny", "--admin-token", TOKEN, "--ray-address", ray_address,
        "--cache-dir", str(demo_cache), "--batch-timeout-ms", "2",
    ]  # fmt: skip
    with running_server(args, tmp_path) as srv:
        yield srv.url


def test_small_sweep_writes_every_file(server: str, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    # No warm-up: each locust run lasts ceil(warm-up + duration) s, so 1 s each, not 2 (the
    # server warmed its model before it was ready; what is measured is not asserted here).
    command = [
        sys.executable, "-m", "serving.cli.main", "tune", "--url", server, "--timeouts", "0,auto",
        "--loads", "4", "--duration", "1", "--warmup", "0", "--repeats", "2", "--slo-p99-ms", "1000",
        "--out", str(out), "--admin-token", TOKEN,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=ray_env(), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["load"], r["timeout"], r["runs"]) for r in rows] == [
        ("c=4", "0", "2"),
        ("c=4", "auto", "2"),
    ]
    assert all(int(r["requests"]) > 0 and float(r["rps"]) > 0 for r in rows)
    with (out / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    # Interleaved: each timeout once, then each again.
    assert [r["timeout"] for r in runs] == ["0", "auto", "0", "auto"]
    assert sum(int(r["requests"]) for r in runs) == sum(int(r["requests"]) for r in rows)

    report = (out / "report.md").read_text()
    assert "## Load c=4" in report
    assert "| 0 ms (median of 2) |" in report
    assert "**winner**" in report
    assert "## auto against the best fixed timeout" in report

    assert (out / "latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    recommended = tomllib.loads((out / "recommended.toml").read_text())["shardserve"]
    assert recommended["batch_timeout_ms"] in (0, "auto")
    assert recommended["slo_p99_ms"] == 1000

    # The sweep puts the server's own policy back.
    view = httpx.get(
        f"{server}/admin/batching", headers={"Authorization": f"Bearer {TOKEN}"}
    ).json()
    assert view["batch_timeout_ms"] == 2.0
