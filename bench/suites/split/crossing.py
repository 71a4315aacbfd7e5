"""The bytes one batch moves between the split bench's processes: computed from the bundle's
stage signatures, and measured in Ray's shared-memory object store.

Ray passes an object under ``INLINE_MAX`` (its ``max_direct_call_object_size``, 100 KiB by
default) inline, with the task's call or its reply; a larger one goes into the node's
shared-memory store, once, and its readers map it from there. So what a batch costs through the
store depends on its size: each stage output at ``batch`` rows is classed by its own bytes. The
driver ``ray.put``s a request tensor that several stages read, whatever its size (store).

The measured figure is Ray's own count: the store's ``cumulative_created_bytes`` (every object
created in the store of this bench's private Ray), read before and after a window of load.
"""

from __future__ import annotations

from typing import Any

import numpy as np

INLINE_MAX = 100 * 1024


def _batch_bytes(specs: Any, batch: int) -> int:
    total = 0
    for t in specs:
        row = int(np.prod([1 if d is None else d for d in t.shape], dtype=np.int64))
        total += batch * row * np.dtype(t.dtype).itemsize
    return total


def _routed(stage: Any) -> bool:
    """A routed row part: per id tensor read, its vectors and their positions (``[]``, int32)."""
    outs = stage.outputs
    return (
        stage.part is not None
        and stage.part.how == "rows"
        and len(outs) == 2 * len(stage.inputs)
        and all(tuple(t.shape) == () and t.dtype == "int32" for t in outs[1::2])
    )


def _written(stage: Any, batch: int) -> dict[str, int]:
    """Each output's bytes for one batch: a routed part's at its share of the ids it read
    (uniform ids: ids / parts per part; over the parts of one call, exactly the ids read)."""
    if not _routed(stage):
        return {t.name: _batch_bytes([t], batch) for t in stage.outputs}
    share = 1 / stage.part.parts
    sizes: dict[str, int] = {}
    for ids, vectors, positions in zip(
        stage.inputs, stage.outputs[0::2], stage.outputs[1::2], strict=True
    ):
        found = batch * int(np.prod([1 if d is None else d for d in ids.shape])) * share
        sizes[vectors.name] = int(found * _batch_bytes([vectors], 1))
        sizes[positions.name] = int(found * 4)
    return sizes


def crossing(stages: Any, batch: int) -> dict[str, int]:
    """Bytes one batch of ``batch`` rows reads and writes across processes, the part stages'
    share of the writes (dense: every part writes the whole output; routed: its rows), and the
    objects' bytes by how Ray carries them: ``store`` (shared memory) or ``inline``."""
    written = {s.name: _written(s, batch) for s in stages}
    made = {name: size for sizes in written.values() for name, size in sizes.items()}
    readers: dict[str, int] = {}
    requested: dict[str, int] = {}
    for s in stages:
        for t in s.inputs:
            readers[t.name] = readers.get(t.name, 0) + 1
            if t.name not in made:
                requested[t.name] = _batch_bytes([t], batch)
    objects = [(size, False) for size in made.values()]
    objects += [(size, readers[name] > 1) for name, size in requested.items()]
    store = sum(size for size, put in objects if put or size >= INLINE_MAX)
    return {
        "read": sum(made.get(t.name, _batch_bytes([t], batch)) for s in stages for t in s.inputs),
        "written": sum(sum(sizes.values()) for sizes in written.values()),
        "parts_written": sum(sum(written[s.name].values()) for s in stages if s.part),
        "store": store,
        "inline": sum(size for size, _ in objects) - store,
    }


def store_created() -> tuple[int, int]:
    """(objects, bytes) created in the running Ray's shared-memory store so far."""
    import ray
    from ray._private.internal_api import get_memory_info_reply

    stats = get_memory_info_reply(ray._private.state.state).store_stats
    return int(stats.cumulative_created_objects), int(stats.cumulative_created_bytes)
