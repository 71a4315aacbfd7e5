"""The bundle cache: pruning to a size, least recently used first, never a bundle being served
or written; a dead server's mark holds nothing. Bundles here are fakes (a manifest head and a
payload): the cache reads nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shards.bundle import cache
from shards.bundle.format import FORMAT_VERSION, MANIFEST_NAME, BundleError


def fake_bundle(
    cache_dir: Path, key: str, size: int, used: float, version: int = FORMAT_VERSION
) -> Path:
    path = cache_dir / key
    path.mkdir(parents=True)
    (path / MANIFEST_NAME).write_text(json.dumps({"format_version": version, "source": key}))
    (path / "stage_000.keras").write_bytes(b"w" * size)
    os.utime(path, (used, used))
    return path


@pytest.fixture
def held_elsewhere(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that holds bundle ``b`` (as a server does) until its stdin closes."""
    code = (
        "import sys\nfrom pathlib import Path\nfrom shards.bundle.cache import hold\n"
        f"print(hold(Path({str(tmp_path / 'b')!r})), flush=True)\nsys.stdin.read()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    yield proc
    proc.kill()
    proc.wait()


def test_prune_removes_least_recently_used_first(tmp_path: Path) -> None:
    for key, used in (("a", 1e9 + 3), ("b", 1e9 + 1), ("c", 1e9 + 2)):
        fake_bundle(tmp_path, key, 1000, used)
    removed = cache.prune(tmp_path, max_bytes=2500)
    assert [e.key for e in removed] == ["b"]
    assert [e.key for e in cache.entries(tmp_path)] == ["c", "a"]
    assert not any(p.name.startswith(cache.TRASH) for p in tmp_path.iterdir())


def test_prune_removes_other_formats_before_any_current_bundle(tmp_path: Path) -> None:
    fake_bundle(tmp_path, "old-format", 1000, used=1e9 + 9, version=1)
    fake_bundle(tmp_path, "current", 1000, used=1e9)
    assert [e.key for e in cache.prune(tmp_path, max_bytes=1500)] == ["old-format"]


def test_prune_keeps_what_it_is_told(tmp_path: Path) -> None:
    fake_bundle(tmp_path, "new", 1000, used=1e9)
    assert cache.prune(tmp_path, max_bytes=0, keep=["new"]) == []


def test_a_bundle_served_by_a_live_process_is_never_removed(
    tmp_path: Path, held_elsewhere: subprocess.Popen[str]
) -> None:
    fake_bundle(tmp_path, "b", 1000, used=1e9)
    assert held_elsewhere.stdout is not None
    assert held_elsewhere.stdout.readline().strip() == "True"
    assert [e.in_use for e in cache.entries(tmp_path)] == [True]
    assert cache.prune(tmp_path, max_bytes=0) == []
    # The server exits (or crashes): its mark goes with it.
    held_elsewhere.kill()
    held_elsewhere.wait()
    assert [e.key for e in cache.prune(tmp_path, max_bytes=0)] == ["b"]
    assert not (tmp_path / "b").exists()


def test_hold_fails_for_a_bundle_pruned_before_the_mark(tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, "b", 10, used=1e9)
    cache.prune(tmp_path, max_bytes=0)
    assert not cache.hold(bundle)
    assert cache.entries(tmp_path) == []


def test_hold_marks_last_use(tmp_path: Path) -> None:
    bundle = fake_bundle(tmp_path, "b", 10, used=1e9)
    assert cache.hold(bundle)
    try:
        assert cache.entries(tmp_path)[0].last_used > 1e9 + 3600
    finally:
        cache.release(bundle)


def test_holds_are_counted_and_the_last_release_frees_the_bundle(tmp_path: Path) -> None:
    # Two versions serving one bundle: the first retired must not free it under the second.
    bundle = fake_bundle(tmp_path, "b", 10, used=1e9)
    assert cache.hold(bundle) and cache.hold(bundle)
    cache.release(bundle)
    assert [e.in_use for e in cache.entries(tmp_path)] == [True]
    assert cache.prune(tmp_path, max_bytes=0) == []
    cache.release(bundle)
    assert [e.in_use for e in cache.entries(tmp_path)] == [False]
    cache.release(bundle)  # one too many: nothing
    assert [e.key for e in cache.prune(tmp_path, max_bytes=0)] == ["b"]


def test_a_bundle_being_written_is_kept_and_a_crashed_writers_is_cleared(tmp_path: Path) -> None:
    crashed = tmp_path / f"{cache.PARTIAL}x-abc"
    crashed.mkdir()
    (crashed / "stage_000.keras").write_bytes(b"w" * 100)
    os.utime(crashed, (1e9, 1e9))
    with cache.writing(tmp_path, "y") as partial:
        os.utime(partial, (1e9, 1e9))  # as old, but its writer is alive
        cache.prune(tmp_path, max_bytes=0)
        assert partial.exists()
        assert not crashed.exists()


def test_a_private_cache_directory_is_created_and_accepted(tmp_path: Path) -> None:
    cache_dir = tmp_path / "a" / "cache"
    assert cache.ensure_private(cache_dir) == cache_dir
    assert cache_dir.is_dir()
    assert cache.ensure_private(cache_dir) == cache_dir  # and again, once it exists


@pytest.mark.parametrize(
    ("mode", "who"), [(0o775, "its group"), (0o757, "others"), (0o1777, "its group and others")]
)
def test_a_cache_directory_others_can_write_to_is_refused(
    tmp_path: Path, mode: int, who: str
) -> None:
    """A bundle (or a shipped stage) placed in the cache is loaded, and runs, in the server."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache_dir.chmod(mode)
    with pytest.raises(BundleError) as refused:
        cache.ensure_private(cache_dir)
    message = str(refused.value)
    assert f"cache directory {str(cache_dir)!r} is not private: {who} can write to it" in message
    assert f"(mode {mode & 0o7777:o})" in message
    assert f"chmod go-w {str(cache_dir)!r}" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir(mode=0o755)
    os.chown(cache_dir, 4321, -1)
    with pytest.raises(BundleError, match=r"its owner \(uid 4321\) can write to it"):
        cache.ensure_private(cache_dir)
