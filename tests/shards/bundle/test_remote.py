"""A model resolved to a bundle in a Ray task on this node (``shards.source.remote``)."""

from __future__ import annotations

from pathlib import Path

from shards.bundle import cache
from shards.bundle.format import read_manifest
from shards.source.remote import resolve_bundle_remote
from shards.source.resolve import ResolveOptions


async def test_resolve_bundle_remote_writes_a_bundle(ray_address: str, tmp_path: Path) -> None:
    bundle = await resolve_bundle_remote(
        "demo-tiny", ResolveOptions(stages=2, max_stage_bytes=None, imports=(), cache_dir=tmp_path)
    )

    assert bundle.is_relative_to(tmp_path)
    assert len(read_manifest(bundle).stages) == 2
    # Marked as served by this process (the server's): no prune may remove it.
    try:
        assert [e.in_use for e in cache.entries(tmp_path)] == [True]
        assert cache.prune(tmp_path, max_bytes=0) == []
    finally:
        cache.release(bundle)
