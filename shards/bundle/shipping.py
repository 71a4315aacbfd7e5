"""Stage files that travel with their actors, for nodes that do not have the bundle on disk.

The driver reads a stage's file (a SavedModel stage's directory is tarred in memory) and puts the
bytes into Ray's object store once per stage; each actor of that stage gets the ObjectRef inside
a ``ShippedStage``. Nested, not a top-level argument: Ray fetches a top-level ObjectRef before
the actor starts, even on a node whose own copy of the file is good. The actor loads its node's
copy when it has the driver's size and sha256, otherwise it fetches the bytes into a
content-addressed cache directory laid out as a one-stage bundle (the manifest plus that stage's
file), so ``bundle.load_stage`` reads it unchanged. Only plain file reads here: no TensorFlow.

The stage cache is kept the way the bundle cache is (``shards.bundle.cache``): an actor holds
its entry (a shared ``flock`` for as long as its process lives) and then prunes the cache to
``max_bytes``, least recently used entries first; an entry an actor holds, on this node or any
sharing the directory, is never removed. Without it every new version shipped to a node stayed
on its disk for good.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shards.bundle.cache import DEFAULT_MAX_BYTES, ensure_private, hold, prune
from shards.bundle.format import MANIFEST_NAME, BundleError, Manifest, sha256_file

StageSource = Literal["local", "shipped"]
_CHUNK = 1 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageDigest:
    """Total bytes and sha256 of a stage file, or of a stage directory's files and names."""

    size: int
    sha256: str


@dataclass(frozen=True)
class ShippedStage:
    """What the driver hands a stage's actors: its manifest, the file's digest and, when the
    bytes were put in the object store, ``payload == (ObjectRef,)``."""

    file: str
    is_dir: bool
    digest: StageDigest
    manifest: dict[str, Any]
    payload: tuple[Any, ...] = ()


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "shardserve" / "stages"


def digest_stage_file(path: Path) -> StageDigest:
    if path.is_dir():
        # Names and sizes enter the digest too: a renamed or moved file is a different model.
        lines = hashlib.sha256()
        total = 0
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            size = file.stat().st_size
            total += size
            rel = file.relative_to(path).as_posix()
            lines.update(f"{rel}\0{size}\0{sha256_file(file)}\n".encode())
        return StageDigest(total, lines.hexdigest())
    return StageDigest(path.stat().st_size, sha256_file(path))


def ship_stage(bundle_dir: Path, manifest: Manifest, index: int, *, put: bool) -> ShippedStage:
    """Digest stage ``index``'s file on this node; with ``put``, also store its bytes in Ray."""
    spec = manifest.stages[index]
    path = Path(bundle_dir) / spec.file
    if not path.exists():
        raise BundleError(f"stage {index} file {str(path)!r} is missing from the bundle")
    payload: tuple[Any, ...] = ()
    if put:
        import ray

        payload = (ray.put(_read_payload(path, spec.file)),)
    digest = digest_stage_file(path)
    return ShippedStage(spec.file, path.is_dir(), digest, manifest.to_json(), payload)


def stage_dir_for(
    bundle_dir: str,
    index: int,
    shipped: ShippedStage | None,
    cache_dir: Path,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[Path, StageSource]:
    """The bundle directory to load stage ``index`` from on this node, and where it came from.
    A shipped stage's entry is held by this process from here on, and the cache pruned to
    ``max_bytes`` around it."""
    local = Path(bundle_dir)
    if shipped is None or _local_copy_matches(local, shipped):
        return local, "local"
    # An entry found there is loaded without hashing it again: nobody else may write there.
    cache_dir = ensure_private(cache_dir)
    target = cache_dir / _cache_key(index, shipped)
    # Twice: another actor's prune may remove the entry between its write and the hold.
    for _ in range(2):
        if not (target / MANIFEST_NAME).is_file():
            _fetch_entry(target, index, local, shipped)
        if hold(target):
            break
    else:
        raise BundleError(
            f"stage {index}'s entry in the stage cache {str(cache_dir)!r} was removed twice "
            "while it was being loaded; raise the cache's size (cache_max_bytes)"
        )
    try:
        removed = prune(cache_dir, max_bytes, keep=(target.name,))
    except OSError as exc:  # a full or read-only disk: the stage still loads
        log.warning("pruning the stage cache %s failed: %s", cache_dir, exc)
    else:
        if removed:
            log.info(
                "stage cache %s: removed %d least recently used entries (%d bytes) to stay "
                "under %d bytes",
                cache_dir,
                len(removed),
                sum(e.size_bytes for e in removed),
                max_bytes,
            )
    return target, "shipped"


def _fetch_entry(target: Path, index: int, local: Path, shipped: ShippedStage) -> None:
    if not shipped.payload:
        raise BundleError(
            f"stage {index} file {str(local / shipped.file)!r} is missing on this node or differs "
            f"from the driver's (size {shipped.digest.size}, sha256 {shipped.digest.sha256[:12]}) "
            "and no bytes were shipped; put the bundle on a shared filesystem or leave "
            "ship_stages on"
        )
    import ray

    data = ray.get(shipped.payload[0])
    _write_cache_entry(target, shipped, np.asarray(data, dtype=np.uint8))


def _local_copy_matches(bundle_dir: Path, shipped: ShippedStage) -> bool:
    path = bundle_dir / shipped.file
    if not (bundle_dir / MANIFEST_NAME).is_file() or not path.exists():
        return False
    if path.is_file() and path.stat().st_size != shipped.digest.size:
        return False  # no need to hash a file whose size already differs
    return digest_stage_file(path) == shipped.digest


def _cache_key(index: int, shipped: ShippedStage) -> str:
    # The manifest is part of the key: the same stage bytes may sit at another index elsewhere.
    manifest = json.dumps(shipped.manifest, sort_keys=True)
    return hashlib.sha256(f"{shipped.digest.sha256}:{index}:{manifest}".encode()).hexdigest()


def _write_cache_entry(target: Path, shipped: ShippedStage, data: np.ndarray) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed into place: a crash or a second actor of the same stage on this
    # node never leaves a half-written entry that a later actor would load.
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{target.name[:16]}-", dir=target.parent))
    try:
        dest = tmp / shipped.file
        if shipped.is_dir:
            with tarfile.open(fileobj=io.BytesIO(data.data), mode="r:") as tar:
                tar.extractall(tmp, filter="data")
        else:
            with dest.open("wb") as f:
                f.write(data.data)
        got = digest_stage_file(dest)
        if got != shipped.digest:
            raise BundleError(
                f"shipped stage file {shipped.file!r} arrived as {got}; expected {shipped.digest}"
            )
        (tmp / MANIFEST_NAME).write_text(json.dumps(shipped.manifest, indent=2), encoding="utf-8")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MANIFEST_NAME).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_payload(path: Path, name: str) -> np.ndarray:
    if path.is_dir():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:") as tar:
            tar.add(path, arcname=name)
        return np.frombuffer(buffer.getbuffer(), dtype=np.uint8)
    if path.stat().st_size == 0:
        return np.empty(0, dtype=np.uint8)
    # A memory map: ray.put copies the pages into the object store without a second copy of a
    # multi-GB stage on the driver's heap.
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


def stages_off_node(groups: Sequence[Any], node_id: str) -> set[int]:
    """The stage indices that some placement group put on a node other than ``node_id``.

    A bundle whose node the table does not name counts as off the node: shipping is the safe
    side of the doubt.
    """
    from ray.util import placement_group_table

    away: set[int] = set()
    for group in groups:
        placed = placement_group_table(group).get("bundles_to_node_id", {})
        for index in range(group.bundle_count):
            if placed.get(index) != node_id:
                away.add(index)
    return away


def ship_bundle(
    bundle_dir: Path, manifest: Manifest, mode: bool | None, away: set[int]
) -> list[ShippedStage | None]:
    """Per stage, what its actors get: ``mode`` True ships every stage, False none, None the
    stages in ``away`` (placed on nodes other than the driver's, which holds the bundle)."""
    return [
        ship_stage(bundle_dir, manifest, index, put=True)
        if mode or (mode is None and index in away)
        else None
        for index in range(len(manifest.stages))
    ]
