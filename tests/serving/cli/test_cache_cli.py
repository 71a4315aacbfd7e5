"""`shardserve cache list|prune` and the cache_max_bytes setting. Bundles are fakes (a manifest
head and a payload): the cache reads nothing else."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serving.cli.main import app
from serving.settings.config import ConfigError, load_settings
from shards.bundle import cache
from shards.bundle.format import FORMAT_VERSION, MANIFEST_NAME

runner = CliRunner()


def fake_bundle(cache_dir: Path, key: str, size: int, used: float, version: int) -> Path:
    path = cache_dir / key
    path.mkdir(parents=True)
    manifest = {"format_version": version, "source": f"{key}.keras"}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))
    (path / "stage_000.keras").write_bytes(b"w" * size)
    os.utime(path, (used, used))
    return path


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    fake_bundle(tmp_path, "old-0123", 3 * 1024 * 1024, used=1e9, version=FORMAT_VERSION)
    fake_bundle(tmp_path, "new-4567", 2 * 1024 * 1024, used=2e9, version=FORMAT_VERSION)
    fake_bundle(tmp_path, "v1-89ab", 1024 * 1024, used=3e9, version=1)
    return tmp_path


def rows(output: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in output.splitlines()
        if line.startswith("│")
    ]


def test_list_shows_every_bundle_most_recently_used_first(filled: Path) -> None:
    held = filled / "new-4567"
    assert cache.hold(held)
    try:
        result = runner.invoke(app, ["cache", "list", "--cache-dir", str(filled)])
    finally:
        cache.release(held)
    assert result.exit_code == 0, result.output
    keys = [(r[0], r[1], r[2], r[4]) for r in rows(result.output)]
    assert keys[0][:2] == ("v1-89ab", "v1-89ab.keras (format 1: stale)")
    assert keys[1:] == [
        ("new-4567", "new-4567.keras", "2.0 MiB", "yes"),
        ("old-0123", "old-0123.keras", "3.0 MiB", "no"),
    ]
    assert "3 bundle(s), 6.0 MiB of cache_max_bytes 20.0 GiB" in result.output


def test_prune_to_a_size_removes_stale_then_least_recently_used(filled: Path) -> None:
    result = runner.invoke(
        app, ["cache", "prune", "--cache-dir", str(filled), "--max-bytes", "2.5MiB"]
    )
    assert result.exit_code == 0, result.output
    assert [r[0] for r in rows(result.output)] == ["old-0123", "v1-89ab"]
    assert "removed 2 bundle(s), 4.0 MiB; left 1" in result.output
    assert [e.key for e in cache.entries(filled)] == ["new-4567"]


def test_prune_all_keeps_only_what_is_served(filled: Path) -> None:
    held = filled / "old-0123"
    assert cache.hold(held)
    try:
        result = runner.invoke(app, ["cache", "prune", "--all", "--cache-dir", str(filled)])
    finally:
        cache.release(held)
    assert result.exit_code == 0, result.output
    assert "left 1 (3.0 MiB, 1 in use)" in result.output
    assert [e.key for e in cache.entries(filled)] == ["old-0123"]


def test_prune_defaults_to_the_setting(filled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_CACHE_MAX_BYTES", "3MiB")
    result = runner.invoke(app, ["cache", "prune", "--cache-dir", str(filled)])
    assert result.exit_code == 0, result.output
    assert [e.key for e in cache.entries(filled)] == ["new-4567"]


def test_prune_refuses_a_bad_size(filled: Path) -> None:
    result = runner.invoke(app, ["cache", "prune", "--cache-dir", str(filled), "--max-bytes", "x"])
    assert result.exit_code == 2
    assert "cannot read 'x' as a byte size" in result.output
    assert len(cache.entries(filled)) == 3


@pytest.mark.parametrize(("given", "want"), [("20GiB", 20 * 1024**3), ("0", 0), (1000, 1000)])
def test_cache_max_bytes_takes_units(given: str | int, want: int) -> None:
    assert load_settings(cache_max_bytes=given).cache_max_bytes == want


def test_cache_max_bytes_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="cache_max_bytes: cannot read 'lots' as a byte size"):
        load_settings(cache_max_bytes="lots")
