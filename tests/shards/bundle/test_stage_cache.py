"""A node's cache of shipped stages is pruned as each actor takes its entry: least recently used
entries first, down to the bound; never the entry the actor loads, nor one another actor holds
(here a fake entry this process holds). No Ray: the actor's entry is in the cache already."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shards.bundle import cache
from shards.bundle.format import MANIFEST_NAME
from shards.bundle.shipping import (
    ShippedStage,
    StageDigest,
    _cache_key,
    _write_cache_entry,
    stage_dir_for,
)

DATA = b"s" * 4000


def old_entry(stages: Path, key: str, size: int, used: float) -> Path:
    path = stages / key
    path.mkdir(parents=True)
    (path / MANIFEST_NAME).write_text(json.dumps({"format_version": 0, "source": key}))
    (path / "stage_000.keras").write_bytes(b"w" * size)
    os.utime(path, (used, used))
    return path


@pytest.fixture
def held() -> Iterator[list[Path]]:
    taken: list[Path] = []
    yield taken
    for path in taken:
        cache.release(path)


def test_an_actor_prunes_its_nodes_stage_cache_around_what_is_in_use(
    tmp_path: Path, held: list[Path]
) -> None:
    stages = tmp_path / "stages"
    stages.mkdir(mode=0o700)
    shipped = ShippedStage(
        "stage_000.keras",
        False,
        StageDigest(len(DATA), hashlib.sha256(DATA).hexdigest()),
        {"format_version": 1, "source": "m", "stages": []},
    )
    mine = stages / _cache_key(0, shipped)
    _write_cache_entry(mine, shipped, np.frombuffer(DATA, dtype=np.uint8))
    oldest = old_entry(stages, "a" * 64, 3000, used=1000.0)
    older = old_entry(stages, "b" * 64, 3000, used=2000.0)
    in_use = old_entry(stages, "c" * 64, 3000, used=500.0)  # the oldest, but served
    assert cache.hold(in_use)
    held.append(in_use)
    sizes = {e.path.name: e.size_bytes for e in cache.entries(stages)}
    bound = sizes[mine.name] + sizes[in_use.name] + 100

    where, source = stage_dir_for(str(tmp_path / "absent"), 0, shipped, stages, bound)
    held.append(mine)

    assert (where, source) == (mine, "shipped")
    assert not oldest.exists() and not older.exists()
    assert in_use.exists() and (mine / shipped.file).read_bytes() == DATA
    # The actor holds its entry from then on: a later prune to nothing leaves it.
    cache.prune(stages, 0)
    assert (mine / MANIFEST_NAME).is_file()
