"""4 stages on a machine with fewer cores, with the defaults: the server starts its own local
Ray, splits the cores between the stage actors and answers; that Ray listens on the loopback
only and its workers do not inherit the admin token."""

from __future__ import annotations

import ipaddress
import math
import os
import signal
import time
from collections.abc import Iterator

import httpx
import numpy as np
import psutil
import pytest

from tests.serverproc import Server, running_server

ADMIN_TOKEN = "admin-token-the-workers-must-not-see"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("small_machine")
    args = ["--model", "demo-mlp", "--stages", "4", "--cache-dir", str(workdir / "cache")]
    env = {"SHARDSERVE_ADMIN_TOKEN": ADMIN_TOKEN}
    with running_server(args, workdir, env=env) as srv:
        yield srv


def test_the_private_ray_listens_on_the_loopback_and_hides_the_admin_token(
    server: Server,
) -> None:
    """Anyone who reaches a Ray port runs code on the node; model code runs in Ray's workers."""
    reply = httpx.get(
        f"{server.url}/admin/batching", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    assert reply.status_code == 200, reply.text  # the server itself still has the token
    ray_processes = psutil.Process(server.process.pid).children(recursive=True)
    names = {p.name() for p in ray_processes}
    assert {"gcs_server", "raylet"} <= names, names
    assert any("ShardActor" in _cmdline(p) for p in ray_processes), names
    listening = [
        (p.name(), c.laddr.ip, c.laddr.port)
        for p in ray_processes
        for c in _connections(p)
        if c.status == psutil.CONN_LISTEN
    ]
    assert len(listening) >= 4, listening  # GCS, raylet, object manager, workers...
    exposed = [entry for entry in listening if not _loopback(entry[1])]
    assert exposed == [], f"the private Ray listens beyond 127.0.0.1: {exposed}"
    seen = [p.name() for p in ray_processes if ADMIN_TOKEN in "".join(_environ(p).values())]
    assert seen == [], f"processes of the private Ray inherited the admin token: {seen}"


def test_four_stages_start_on_a_private_ray_with_defaults(server: Server) -> None:
    # Last in the module: it stops the server.
    meta = httpx.get(f"{server.url}/v1/models/demo-mlp/metadata", timeout=10).json()
    assert meta["num_stages"] == 4
    shape = meta["inputs"][0]["shape"]
    rows = np.random.default_rng(0).normal(size=(3, *shape)).round(3).tolist()
    reply = httpx.post(f"{server.url}/predict", json={"instances": rows}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["predictions"]) == 3
    log = server.output()
    # SIGTERM to the server alone, as Docker and Kubernetes send it (not to its group): the
    # private Ray it started goes with it. uvicorn's re-raised signal skips Ray's exit
    # handler, and its dashboard and runtime-env agents were left running, orphaned.
    ray_processes = psutil.Process(server.process.pid).children(recursive=True)
    assert ray_processes
    os.kill(server.process.pid, signal.SIGTERM)
    server.process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while (left := [p for p in ray_processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:
        process.kill()
    assert not left, [p.name() for p in left]
    cores = os.cpu_count() or 1
    # Each asks for the whole TensorFlow threads of its share of the cores (at least one): the
    # private Ray's CPU count is a scheduling count sized to hold them (shards.cpu_plan).
    threads = max(1, math.floor(cores / 4))
    asked = (
        f"4 stage(s) in 4 actor(s) ask for {threads:g} CPU each ({threads} TensorFlow thread(s))"
    )
    assert asked in log


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _connections(process: psutil.Process) -> list[psutil._common.pconn]:
    try:
        # psutil < 6 (kserve pins it) names it connections; 6 renamed it net_connections.
        return process.connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
