"""Resolving a model to a bundle in a Ray task on the caller's node, so the caller (the server's
front end) never imports TensorFlow: the bundle lands on this node's disk, where the caller then
reads its manifest.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shards.bundle import cache
from shards.errors import ResolveError

if TYPE_CHECKING:
    from shards.source.resolve import ResolveOptions


def _resolve_in_worker(model: str, options: ResolveOptions) -> str:
    from shards.source.resolve import resolve_bundle

    return str(resolve_bundle(model, options))


async def resolve_bundle_remote(model: str, options: ResolveOptions) -> Path:
    """Run ``shards.source.resolve.resolve_bundle`` in a Ray task, so the caller never imports TF.

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
    # A prune by another process can remove the entry between the task's answer and the mark.
    for _ in range(3):
        ref = task.remote(model, options)
        answer: str = await asyncio.wrap_future(ref.future())
        path = Path(answer)
        in_cache = path.parent.resolve() == options.cache_dir.resolve()
        if not in_cache or await asyncio.to_thread(cache.hold, path):
            return path
    raise ResolveError(
        f"the cached bundle of {model!r} was removed by another process's cache prune three "
        "times while loading; raise cache_max_bytes"
    )
