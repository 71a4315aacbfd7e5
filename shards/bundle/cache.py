"""The bundle cache on disk: its entries, who serves them, and pruning it to a size.

Layout of ``cache_dir``::

    <key>/                      a finished bundle, renamed into place whole (shards.source.resolve)
    .partial-<key>-XXXX/        a bundle being written
    .locks/<name>.lock          an entry's lock (see below)
    .trash-XXXX/                an entry being deleted
    .digests.json               model digests (shards.bundle.fingerprint)

Serving is marked with ``flock``: every process that serves an entry holds a shared lock on its
lock file for as long as it lives, and the writer of a ``.partial-`` directory an exclusive one.
Pruning takes an entry's lock exclusively and without waiting, so an entry being served or
written is never removed; the kernel drops a dead process's locks, so no stale marker outlives
it (nor a pid reused by another process). flock works between containers sharing the directory
and, on Linux, over NFS. An entry's last use is its directory's mtime, touched by each resolve.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shards.bundle.format import FORMAT_VERSION, MANIFEST_NAME, BundleError

LOCKS = ".locks"
PARTIAL = ".partial-"
TRASH = ".trash-"
GiB = 1024**3
DEFAULT_MAX_BYTES = 20 * GiB
# A writer holds its partial's lock; one older than this whose lock is free was left by a crash.
_ABANDONED_S = 3600.0

_held: dict[Path, int] = {}  # bundle -> fd of the shared lock this process holds
# bundle -> how many holders in this process (two versions may serve the same bundle): the lock
# goes with the last ``release``.
_holders: dict[Path, int] = {}


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    source: str  # the model it was cut from, as the manifest names it
    format_version: int | None  # None: the manifest cannot be read
    size_bytes: int
    last_used: float  # seconds since the epoch
    in_use: bool

    @property
    def current(self) -> bool:
        """Written by this version's format; any other is never reused."""
        return self.format_version == FORMAT_VERSION


def hold(bundle: Path) -> bool:
    """Mark ``bundle``, an entry of a cache, as served by this process until it exits or each
    ``hold`` that returned True has its ``release`` (holds are counted: two versions may serve
    one bundle). False when a prune removed it before the mark was taken: resolve it again."""
    bundle = bundle.resolve()
    if bundle in _held:
        _holders[bundle] += 1
        return True
    try:
        fd = _lock(_lock_path(bundle.parent, bundle.name), fcntl.LOCK_SH)
    except OSError:
        # A read-only cache: nothing here can prune it either.
        return (bundle / MANIFEST_NAME).is_file()
    if not (bundle / MANIFEST_NAME).is_file():
        os.close(fd)
        return False
    _held[bundle] = fd
    _holders[bundle] = 1
    touch(bundle)
    return True


def release(bundle: Path) -> None:
    """End one ``hold`` of ``bundle``; the last one frees it for a prune (nothing when this
    process does not hold it)."""
    bundle = bundle.resolve()
    left = _holders.get(bundle, 0) - 1
    if left > 0:
        _holders[bundle] = left
        return
    _holders.pop(bundle, None)
    fd = _held.pop(bundle, None)
    if fd is not None:
        os.close(fd)


def touch(bundle: Path) -> None:
    # A read-only cache: last use stays at the bundle's creation.
    with contextlib.suppress(OSError):
        os.utime(bundle)


@contextlib.contextmanager
def writing(cache_dir: Path, key: str) -> Iterator[Path]:
    """A new ``.partial-`` directory for ``key``, locked against pruning while it is written;
    removed on the way out unless the caller renamed it into place."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{key[:40]}-", dir=cache_dir))
    lock = _lock_path(cache_dir, tmp.name)
    fd = _lock(lock, fcntl.LOCK_EX)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        lock.unlink(missing_ok=True)
        os.close(fd)


def entries(cache_dir: Path) -> list[Entry]:
    """The finished bundles in ``cache_dir``, least recently used first."""
    found = []
    for path in _children(cache_dir):
        if path.name.startswith(".") or not (path / MANIFEST_NAME).is_file():
            continue  # a partial, the locks, or another cache (shards.bundle.shipping's stages/)
        source, version = _manifest_head(path)
        try:
            last_used = path.stat().st_mtime
        except FileNotFoundError:
            continue  # pruned by another process meanwhile
        found.append(
            Entry(
                path.name, path, source, version, _size(path), last_used, _in_use(cache_dir, path)
            )
        )
    return sorted(found, key=lambda e: e.last_used)


def prune(cache_dir: Path, max_bytes: int, keep: Iterable[str] = ()) -> list[Entry]:
    """Remove entries until the cache holds at most ``max_bytes``: other format versions first,
    then the least recently used; never one being served or written, nor a key in ``keep``.
    Also clears what crashed writers and deleters left. Returns the entries removed."""
    if not cache_dir.is_dir() or not os.access(cache_dir, os.W_OK):
        return []  # nothing to prune, or nothing this process may remove (a read-only cache)
    kept = set(keep)
    with _prune_lock(cache_dir):
        _clear_leftovers(cache_dir)
        listed = entries(cache_dir)
        total = sum(e.size_bytes for e in listed) + _partial_bytes(cache_dir)
        removed = []
        for entry in sorted(listed, key=lambda e: (e.current, e.last_used)):
            if total <= max_bytes:
                break
            if entry.key not in kept and _remove(cache_dir, entry.path):
                removed.append(entry)
                total -= entry.size_bytes
    return removed


def _remove(cache_dir: Path, bundle: Path) -> bool:
    lock = _lock_path(cache_dir, bundle.name)
    fd = _try_lock(lock, fcntl.LOCK_EX)
    if fd is None:
        return False  # being served
    try:
        trash = Path(tempfile.mkdtemp(prefix=TRASH, dir=cache_dir))
        os.rename(bundle, trash / bundle.name)
        # Unlinked while locked: a process that opened it before sees it unlinked and retries.
        lock.unlink(missing_ok=True)
    finally:
        os.close(fd)
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _clear_leftovers(cache_dir: Path) -> None:
    for path in _children(cache_dir):
        if path.name.startswith(TRASH):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith(PARTIAL) and _abandoned(cache_dir, path):
            shutil.rmtree(path, ignore_errors=True)
            _lock_path(cache_dir, path.name).unlink(missing_ok=True)
    # Lock files of entries gone (a hold that lost the race to a prune leaves one).
    for lock in _children(cache_dir / LOCKS):
        name = lock.name.removesuffix(".lock")
        if name == ".prune" or (cache_dir / name).exists():
            continue
        fd = _try_lock(lock, fcntl.LOCK_EX)
        if fd is not None:
            lock.unlink(missing_ok=True)
            os.close(fd)


def _abandoned(cache_dir: Path, partial: Path) -> bool:
    try:
        if time.time() - partial.stat().st_mtime < _ABANDONED_S:
            return False
    except FileNotFoundError:
        return False
    fd = _try_lock(_lock_path(cache_dir, partial.name), fcntl.LOCK_EX)
    if fd is None:
        return False
    os.close(fd)
    return True


def _partial_bytes(cache_dir: Path) -> int:
    return sum(_size(p) for p in _children(cache_dir) if p.name.startswith(PARTIAL))


def _in_use(cache_dir: Path, bundle: Path) -> bool:
    if bundle.resolve() in _held:
        return True
    fd = _try_lock(_lock_path(cache_dir, bundle.name), fcntl.LOCK_EX)
    if fd is None:
        return True
    os.close(fd)
    return False


@contextlib.contextmanager
def _prune_lock(cache_dir: Path) -> Iterator[None]:
    # One pruner at a time: two would each count the other's removals as still there.
    fd = _lock(_lock_path(cache_dir, ".prune"), fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def _lock_path(cache_dir: Path, name: str) -> Path:
    return cache_dir / LOCKS / f"{name}.lock"


def _lock(path: Path, how: int) -> int:
    """Open and flock ``path``, waiting; retried when a pruner unlinked the file meanwhile (a
    lock on an unlinked file would guard nothing)."""
    while True:
        fd = _open(path)
        fcntl.flock(fd, how)
        if _still_linked(fd, path):
            return fd
        os.close(fd)


def _try_lock(path: Path, how: int) -> int | None:
    """The lock, or None when another process holds it (or it cannot be made: a read-only
    cache counts as in use, so nothing is removed from it)."""
    while True:
        try:
            fd = _open(path)
        except OSError:
            return None
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _still_linked(fd, path):
            return fd
        os.close(fd)


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _still_linked(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _children(cache_dir: Path) -> list[Path]:
    try:
        return list(cache_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _size(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _manifest_head(bundle: Path) -> tuple[str, int | None]:
    """The source and format version, read without validating the rest (an old format's
    manifest is listed too)."""
    import json

    try:
        data = json.loads((bundle / MANIFEST_NAME).read_text(encoding="utf-8"))
        version = data.get("format_version")
        return str(data.get("source", "?")), version if isinstance(version, int) else None
    except (OSError, ValueError, AttributeError):
        return "?", None


def ensure_private(cache_dir: Path) -> Path:
    """Create ``cache_dir`` if missing and refuse it when someone other than this user (or
    root) could write to it: a bundle or a stage file placed there is loaded, and runs, in the
    server. Returns it."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        info = cache_dir.stat()
    except OSError as exc:
        raise BundleError(f"cannot use cache directory {str(cache_dir)!r}: {exc}") from None
    bits = ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
    writers = [who for bit, who in bits if info.st_mode & bit]
    if info.st_uid not in (os.geteuid(), 0):
        writers.insert(0, f"its owner (uid {info.st_uid})")
    if writers:
        raise BundleError(
            f"cache directory {str(cache_dir)!r} is not private: {' and '.join(writers)} can "
            f"write to it (mode {stat.S_IMODE(info.st_mode):o}), and a bundle placed there runs "
            f"code in the server; fix: chown it to this user and chmod go-w {str(cache_dir)!r}, "
            "or give --cache-dir a directory of this user's own"
        )
    return cache_dir
