"""Bringing back a replica that left the rotation: probe it, else rebuild it.

A replica whose stage actors still answer (Ray restarts a dead actor that has restarts left) is
probed and warmed with one batch; one whose actors are gone for good, or that ran a compiled
graph (an actor's death closes it), is rebuilt with a new placement group and actors, with
backoff, until it is back or its ``ReplicaSet`` closes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from shards.errors import one_line
from shards.pipeline.health import ReplicaState
from shards.pipeline.placement import Layout, new_replica, start_replica, warm
from shards.pipeline.replica import Replica, release
from shards.signature import ModelSignature

log = logging.getLogger(__name__)

# Pauses between attempts to rebuild a replica: doubling from the first to the last.
REBUILD_BACKOFF_S = (1.0, 60.0)


class Recovered(enum.Enum):
    PROBED = "its stage actors answer again"
    REBUILT = "rebuilt"


async def recover(
    replica: Replica,
    index: int,
    layout: Layout,
    signature: ModelSignature,
    *,
    hung: bool,
    closed: Callable[[], bool],
    failed: Callable[[str], None] | None = None,
) -> Recovered | None:
    """Bring replica ``index`` back, warm; None when ``closed()`` ended the rebuilds first.
    A ``hung`` replica's actors are killed first: a running task is not interrupted otherwise.
    ``failed`` hears why each rebuild attempt failed (the tries go on, with backoff)."""
    options = layout.options
    probe_s = min(options.ready_timeout_s, 120.0)
    if replica.compiled is None:
        if hung:
            await asyncio.to_thread(replica.kill_actors)
        try:
            await replica.probe(probe_s)
            await warm(replica, signature, options.ready_timeout_s)
            return Recovered.PROBED
        except Exception as exc:
            log.warning("replica %d: probe failed (%s); rebuilding it", index, one_line(exc))
    # A compiled graph is closed by an actor's death: the replica is always rebuilt.
    replica.state = ReplicaState.DEAD
    pause = REBUILD_BACKOFF_S[0]
    while not closed():
        try:
            await rebuild(replica, index, layout, signature)
            return Recovered.REBUILT
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning(
                "replica %d: rebuild failed (%s); next try in %g s",
                index,
                one_line(exc),
                pause,
            )
            if failed is not None:
                failed(one_line(exc))
            await asyncio.sleep(pause)
            pause = min(pause * 2, REBUILD_BACKOFF_S[1])
    return None


async def rebuild(old: Replica, index: int, layout: Layout, signature: ModelSignature) -> None:
    """Build replica ``index`` again from ``layout`` and swap it into ``old``, warm."""
    # The old actors and group go first: on a full cluster the new ones need their place.
    await asyncio.to_thread(release, old.actors, old.placement_group, old.compiled)
    old.actors, old.compiled = [], None
    fresh = new_replica(layout)
    try:
        await start_replica(fresh, layout, signature, index)
    except BaseException:
        await asyncio.to_thread(fresh.close)
        raise
    old.swap(fresh)
