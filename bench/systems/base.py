"""A server subprocess in its own session: started, awaited until it answers, stopped for sure."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from bench import options

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "PYTHONUNBUFFERED": "1",
}


def peer_args() -> argparse.Namespace:
    """The command line every peer server script takes (``bench.systems.peers`` passes it)."""
    parser = argparse.ArgumentParser()
    opts = options.Options(parser)
    opts.add("model", required=True, help="a .keras file")
    opts.add("port", required=True, help="the port to serve on")
    options.Options(parser, SystemConfig).add("max_batch_size", "batch_timeout_ms")
    return parser.parse_args()


@dataclass(frozen=True)
class SystemConfig:
    """What every system is given, so that they are compared on the same terms."""

    model_path: Path
    port: int
    max_batch_size: int = 64
    batch_timeout_ms: float | str = 5.0
    simulate_device_ms: float | None = None


@dataclass(frozen=True)
class LaunchSpec:
    name: str
    argv: list[str]
    ready_timeout_s: float = 180.0
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None  # another code tree (a git worktree of an older commit, say)


class ServerStartError(RuntimeError):
    """The server exited or did not answer within its start-up time."""


class ServerProcess:
    """``with ServerProcess(spec, port, body) as server:`` -- ready once a real predict answers
    200 (``path``: the route posted to, ``/predict`` unless given)."""

    def __init__(
        self, spec: LaunchSpec, port: int, body: bytes, log_path: Path, path: str = "/predict"
    ) -> None:
        self.spec = spec
        self.url = f"http://127.0.0.1:{port}{path}"
        self._body = body
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"server {self.spec.name!r} is not running")
        return self._proc.pid

    def __enter__(self) -> ServerProcess:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self._log_path.open("wb")
        env = subprocess_env(self.spec.env)
        # A session of its own: on stop, the whole group (uvicorn workers, Ray daemons) goes.
        self._proc = subprocess.Popen(
            self.spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(
                    f"{self.spec.name} exited with code {self._proc.returncode} while starting; "
                    f"last log lines:\n{self.log_tail()}"
                )
            if self.predict_ok():
                return
            time.sleep(0.5)  # start-up polling of another process; no event to wait on
        raise ServerStartError(
            f"{self.spec.name} did not answer POST {self.url} within "
            f"{self.spec.ready_timeout_s:g} s; last log lines:\n{self.log_tail()}"
        )

    def predict_ok(self) -> bool:
        request = urllib.request.Request(
            self.url, data=self._body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError as exc:
            if 400 <= exc.code < 500 and exc.code != 404:
                # The server is up and refuses the body: waiting longer cannot help.
                raise ServerStartError(
                    f"{self.spec.name} answered {exc.code} to the benchmark body: "
                    f"{exc.read()[:300]!r}"
                ) from None
            return False
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            # SIGTERM first: each server shuts its own Ray down; the group kill is the backstop.
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: quiet, Ray without auth, and ``bench`` importable."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, **BASE_ENV, "PYTHONPATH": path, **(extra or {})}
