"""What the e2e tests of a model repository share: adding a version whole, waiting with a
deadline, and the settings of an in-process server on the session's Ray."""

from __future__ import annotations

import asyncio
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import keras

from serving.settings.config import Settings

DEADLINE_S = 120.0


def add_version(root: Path, name: str, version: int, model: keras.Model | None) -> None:
    """Saved aside, then renamed in: the server sees all of it or none. ``None``: a ``.keras``
    file that names no real layer (a version that cannot load)."""
    staged = root / name / f".{version}.tmp"
    staged.mkdir(parents=True)
    if model is None:
        with zipfile.ZipFile(staged / "m.keras", "w") as broken:
            broken.writestr("config.json", '{"class_name": "NoSuchLayer", "config": {}}')
            broken.writestr("metadata.json", "{}")
    else:
        model.save(staged / "m.keras")
    staged.rename(root / name / str(version))


def first_versions(root: Path, models: dict[str, tuple[keras.Model, str]]) -> Path:
    """A repository at ``root``: each model's version 1 and its ``config.toml``."""
    for name, (model, config) in models.items():
        add_version(root, name, 1, model)
        (root / name / "config.toml").write_text(config)
    return root


async def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:g} s: {what}"
        await asyncio.sleep(0.05)


def repository_settings(
    repository: Path, ray_address: str, cache: Path, cpus_per_shard: float
) -> Settings:
    """Small batches sent at once, token rows of at most 16 ids, the session's Ray."""
    return Settings(
        model_repository=repository,
        ray_address=ray_address,
        cache_dir=cache,
        max_batch_size=4,
        batch_timeout_ms=0,
        cpus_per_shard=cpus_per_shard,
        max_sequence_length=16,
    )
