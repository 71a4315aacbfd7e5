"""Resolving a model to a bundle in a Ray task on the caller's node, so the caller (the server's
front end) never imports TensorFlow: the bundle lands on this node's disk, where the caller then
reads its manifest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shards.bundle import cache
from shards.errors import ResolveError


def _resolve_in_worker(model: str, options: dict[str, Any]) -> str:
    from shards.bundle.resolve import resolve_bundle

    return str(resolve_bundle(model, **options))


async def resolve_bundle_remote(
    model: str,
    *,
    stages: int | None,
    max_stage_bytes: Sequence[int] | None,
    imports: Sequence[str] = (),
    cache_dir: str | Path,
    max_batch_size: int = 32,
    device_overhead_bytes: int | None = None,
    unsafe_deserialization: bool = False,
    weight_dtype: str | None = None,
    cache_max_bytes: int = cache.DEFAULT_MAX_BYTES,
    max_sequence_length: int | None = None,
) -> Path:
    """Run ``shards.bundle.resolve.resolve_bundle`` in a Ray task, so the caller never imports TF.

    The task is pinned to the caller's node: the bundle lands on this node's disk, where the
    caller then reads its manifest. A bundle from the cache is marked as served by the caller's
    process (``shards.bundle.cache.hold``), so no prune removes it while this process lives.
    """
    # No CPU asked: the shard actors may hold every CPU of the node (a private local Ray gives
    # them all) or the node may have none (a head started with --num-cpus=0), and a resolve
    # waiting for a CPU would wait for ever.
    task = ray.remote(num_cpus=0, max_retries=0)(_resolve_in_worker).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id=ray.get_runtime_context().get_node_id(), soft=False
        )
    )
    options: dict[str, Any] = {
        "stages": stages,
        "max_stage_bytes": None if max_stage_bytes is None else tuple(max_stage_bytes),
        "imports": tuple(imports),
        "cache_dir": Path(cache_dir),
        "max_batch_size": max_batch_size,
        "device_overhead_bytes": device_overhead_bytes,
        "unsafe_deserialization": unsafe_deserialization,
        "weight_dtype": weight_dtype,
        "cache_max_bytes": cache_max_bytes,
        "max_sequence_length": max_sequence_length,
    }
    # A prune by another process can remove the entry between the task's answer and the mark.
    for _ in range(3):
        ref = task.remote(model, options)
        answer: str = await asyncio.wrap_future(ref.future())
        path = Path(answer)
        in_cache = path.parent.resolve() == Path(cache_dir).resolve()
        if not in_cache or await asyncio.to_thread(cache.hold, path):
            return path
    raise ResolveError(
        f"the cached bundle of {model!r} was removed by another process's cache prune three "
        "times while loading; raise cache_max_bytes"
    )
