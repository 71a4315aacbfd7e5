"""The Ray runtime helpers on the session Ray: reuse, summary, bundles resolved in a Ray task."""

from __future__ import annotations

from pathlib import Path

from shards.bundle import read_manifest
from shards.runtime import cluster_summary, connect, resolve_bundle_remote


def test_connect_reuses_the_ray_of_this_process(ray_address: str) -> None:
    assert connect(None, num_cpus=1) == ray_address


def test_cluster_summary_counts_the_session_cluster(ray_address: str) -> None:
    summary = cluster_summary()

    assert (summary["nodes"], summary["cpus"], summary["gpus"]) == (1, 4.0, 0.0)


async def test_resolve_bundle_remote_writes_a_bundle(ray_address: str, tmp_path: Path) -> None:
    bundle = await resolve_bundle_remote(
        "demo-tiny", stages=2, max_stage_bytes=None, imports=(), cache_dir=tmp_path
    )

    assert bundle.is_relative_to(tmp_path)
    assert len(read_manifest(bundle).stages) == 2
