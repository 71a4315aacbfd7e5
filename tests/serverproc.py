"""A real ``shardserve serve`` in a subprocess, for end-to-end tests.

Started in its own process session so that a SIGTERM reaches the server (uvicorn drains) and
nothing else; stopped in ``finally`` whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
READY_TIMEOUT_S = 420.0
READY_POLL_S = 0.2


def ray_env() -> dict[str, str]:
    # A real server keeps its default collector freeze (the in-process apps turn it off).
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SHARDSERVE_GC_FREEZE")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", TF_CPP_MIN_LOG_LEVEL="2")
    return env


def free_ports(count: int) -> list[int]:
    # Held open together so that the ports handed out are distinct.
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return int(self.process.returncode)


def wait_ready(server: Server, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{server.url}/readyz").status_code == 200:
                    return
            # Waiting on the process is the pause between probes and ends at once if it dies;
            # short, as every test that starts a server waits out the last pause.
            try:
                server.process.wait(timeout=READY_POLL_S)
            except subprocess.TimeoutExpired:
                continue
            break
    raise RuntimeError(
        f"server not ready (exit code {server.process.poll()}) within {timeout:g} s:\n"
        + server.output()[-6000:]
    )


@contextlib.contextmanager
def running_server(
    args: list[str], workdir: Path, *, ready: bool = True, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """``shardserve serve ARGS --port <free>``; yields once /readyz answers 200 (if ``ready``).

    ``env`` is added to the server's environment (``PYTHONPATH`` for a user's ``--import``)."""
    (port,) = free_ports(1)
    log = workdir / f"server-{port}.log"
    command = [str(BIN / "shardserve"), "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env={**ray_env(), **(env or {})},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(url=f"http://127.0.0.1:{port}", process=process, log=log)
    try:
        if ready:
            wait_ready(server)
        yield server
    finally:
        server.terminate()
