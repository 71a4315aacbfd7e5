"""The rollout bench's server: a model repository on disk, a version copied in as users do
(a hidden directory, then a rename, so that it appears whole), the server started on it with
polling, its capacity measured, and what its repository and admin routes say."""

from __future__ import annotations

import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.load import pyload
from bench.observe.scrape import free_port
from bench.systems import ServerProcess
from bench.systems.base import LaunchSpec

MODEL = "tokens"
ADMIN_TOKEN = "bench-rollout"  # a local server on 127.0.0.1, for the admin routes' sake
READY_BODY = orjson.dumps({"instances": [[1, 2, 3, 4]]})


@dataclass(frozen=True)
class Repository:
    root: Path
    name: str = MODEL

    @classmethod
    def fresh(cls, root: Path, config: str) -> Repository:
        """An empty repository holding the model's ``config.toml``."""
        shutil.rmtree(root, ignore_errors=True)
        (root / MODEL).mkdir(parents=True)
        (root / MODEL / "config.toml").write_text(config)
        return cls(root)

    def add_version(self, version: int, model_file: Path) -> None:
        """Copy ``model_file`` in as ``version``: into a hidden directory, then renamed."""
        hidden = self.root / self.name / f".incoming-{version}"
        hidden.mkdir()
        shutil.copyfile(model_file, hidden / "model.keras")
        hidden.rename(self.root / self.name / str(version))


def config_toml(
    max_batch_size: int,
    batch_timeout_ms: float,
    *,
    simulate_device_ms: float | None = None,
    cpus_per_shard: float | None = None,
    canary: dict[str, Any] | None = None,
    weights: tuple[int, int] = (90, 10),
) -> str:
    """The model's ``config.toml``: its batching, a simulated device, a canary's rules."""
    lines = [f"max_batch_size = {max_batch_size}", f"batch_timeout_ms = {batch_timeout_ms:g}"]
    if simulate_device_ms is not None:
        lines.append(f"simulate_device_ms = {simulate_device_ms:g}")
    if cpus_per_shard is not None:
        lines.append(f"cpus_per_shard = {cpus_per_shard:g}")
    lines += ["", "[versions]", 'policy = "latest"', "n = 1"]
    if canary is not None:
        lines += ["", "[traffic]", f"stable = {weights[0]}", f"canary = {weights[1]}", ""]
        lines.append("[canary]")
        for key, value in canary.items():
            lines.append(f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value}")
    return "\n".join(lines) + "\n"


def server(repo: Repository, workdir: Path, label: str, *, poll_s: float = 1.0) -> ServerProcess:
    """``shardserve serve --model-repository`` on ``repo``, polling it every ``poll_s``; the
    model's batching and devices come from its ``config.toml``."""
    port = free_port()
    exe = shutil.which("shardserve", path=str(Path(sys.executable).parent)) or "shardserve"
    argv = [exe, "serve", "--model-repository", str(repo.root)]
    argv += ["--repository-poll-s", f"{poll_s:g}", "--port", str(port), "--grpc-port", "0"]
    argv += ["--admin-token", ADMIN_TOKEN, "--cache-dir", str(workdir / "cache")]
    argv += ["--log-level", "warning"]
    spec = LaunchSpec(f"shardserve-repository-{label}", argv)
    return ServerProcess(spec, port, READY_BODY, workdir / "logs" / f"rollout-{label}.log")


def infer_url(server: ServerProcess) -> str:
    return f"{base(server)}/v2/models/{MODEL}/infer"


def base(server: ServerProcess) -> str:
    return server.url.rsplit("/", 1)[0]


def capacity(server: ServerProcess, bodies: list[bytes], clients: int, seconds: float) -> float:
    """Answers per second of ``clients`` closed-loop clients (the V2 route, as the load)."""
    result = pyload.run(infer_url(server), bodies, ["--concurrency", str(clients)], seconds)
    return float(result.rps)


def get_json(url: str, *, admin: bool = False, timeout_s: float = 5.0) -> Any:
    """A GET (or, for the repository index, a POST) answered with JSON; None when it fails."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"} if admin else {}
    data = b"{}" if url.endswith("/repository/index") else None
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return orjson.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def rollout_view(server: ServerProcess) -> Callable[[], Any]:
    """A probe: the model's rollout as ``GET /admin/models/{m}/rollout`` shows it."""
    url = f"{base(server)}/admin/models/{MODEL}/rollout"
    return lambda: get_json(url, admin=True)


def index(server: ServerProcess) -> Callable[[], Any]:
    """A probe: the repository index (every version's state and reason)."""
    url = f"{base(server)}/v2/repository/index"
    return lambda: get_json(url)
