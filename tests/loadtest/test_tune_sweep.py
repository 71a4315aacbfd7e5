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

TOKEN = "tune-test-token"


@pytest.fixture
def server(ray_address: str, tmp_path: Path) -> Iterator[str]:
    args = [
        "--model", "demo-tiny", "--admin-token", TOKEN, "--ray-address", ray_address,
        "--cache-dir", str(tmp_path / "cache"), "--batch-timeout-ms", "2",
    ]  # fmt: skip
    with running_server(args, tmp_path) as srv:
        yield srv.url


def test_small_sweep_writes_every_file(server: str, tmp_path: Path) -> None:
    out = tmp_path / "tune"
    command = [
        sys.executable, "-m", "serving.cli", "tune", "--url", server, "--timeouts", "0,auto",
        "--loads", "4", "--duration", "3", "--warmup", "1", "--slo-p99-ms", "1000",
        "--out", str(out), "--admin-token", TOKEN,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env=ray_env(), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]

    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["load"], r["timeout"]) for r in rows] == [("c=4", "0"), ("c=4", "auto")]
    assert all(int(r["requests"]) > 0 and float(r["rps"]) > 0 for r in rows)

    report = (out / "report.md").read_text()
    assert "## Load c=4" in report
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
