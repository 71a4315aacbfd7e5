"""A server of several models and versions, in process: a model repository on disk whose
versions are tiny ``.keras`` zips (complete to the repository's reader, never opened), each
served by its own ``FakeRunner`` (no Ray, no TensorFlow, no socket)."""

from __future__ import annotations

import asyncio
import contextlib
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from asgi_lifespan import LifespanManager

from serving.server.app import create_app
from serving.settings.config import Settings
from tests.fakes import WAIT_S, FakeRunner


class Runners:
    """The runner factory: one ``FakeRunner`` per (model, version), made at its load."""

    def __init__(self) -> None:
        self.made: dict[tuple[str, str], FakeRunner] = {}

    async def __call__(self, settings: Settings) -> FakeRunner:
        version_dir = Path(str(settings.model)).parent
        key = (version_dir.parent.name, version_dir.name)
        self.made[key] = runner = FakeRunner()
        return runner

    def calls(self) -> dict[tuple[str, str], int]:
        return {key: runner.calls_started for key, runner in self.made.items()}


def write_repository(root: Path, models: dict[str, tuple[list[int], str]]) -> Path:
    """``models``: name -> (its versions, its config.toml)."""
    for name, (versions, config) in models.items():
        for version in versions:
            folder = root / name / str(version)
            folder.mkdir(parents=True)
            with zipfile.ZipFile(folder / f"{name}.keras", "w") as archive:
                archive.writestr("config.json", "{}")
        if config:
            (root / name / "config.toml").write_text(config)
    return root


@contextlib.asynccontextmanager
async def serve_repository(
    root: Path, runners: Runners, **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The app over ``root``, once every version it loads at start is ready."""
    settings = Settings(
        model_repository=root, **{"batch_timeout_ms": 0, "max_batch_size": 4, **overrides}
    )
    app = create_app(settings, runners)
    async with LifespanManager(app) as manager:
        state = app.state.shardserve
        await asyncio.wait_for(
            asyncio.gather(*(model.until_ready() for model in state.served())), WAIT_S
        )
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.shardserve = state  # type: ignore[attr-defined]
            yield client
