"""The front end's garbage collector, off the request path: what a load left alive is frozen once
a version is READY, and the first generation's threshold suits a server that allocates per
request.

CPython's collector scans every container object of a generation it collects; after a load the
heap holds the app, the routes, Ray's client, the version's runner and batcher: tens of
thousands of objects that live as long as the process and were scanned again by every older
collection. ``gc.freeze()`` moves them out of the collector's sight. A request allocates a few
hundred short-lived containers (the parsed body, its arrays' wrappers, the answer), so at the
default first threshold (700) gen-0 collections ran every few requests; ``perf`` put 11% of the
front end's CPU in the collector, and freezing after the load with a higher threshold cut its
CPU per request by 13-15% (issue 32). The threshold bounds how many young objects may wait for
a collection, not what is freed: reference counting frees everything but cycles at once, so
memory stays bounded (``python -m bench soak`` samples the RSS under load).

Every READY freezes again (a version switch loaded a new runner): first ``gc.unfreeze()``, so
that what the retired version left (frozen at its own READY, garbage since) is collected then
and not kept for good.
"""

from __future__ import annotations

import gc
import logging
import time

__all__ = ["freeze_heap"]

log = logging.getLogger("shardserve")


def freeze_heap(first_threshold: int) -> None:
    """Collect, then freeze what is alive (``gc.freeze``), and set the first generation's
    threshold (``Settings.gc_first_threshold``); the older two keep CPython's ratios. Called
    when a version becomes READY: before it takes a request, between requests of the versions
    already serving (one pause of the loop, a few to tens of milliseconds)."""
    started = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(first_threshold, second, third)
    log.debug(
        "garbage collector: %d objects frozen in %.1f ms; first threshold %d",
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1000,
        first_threshold,
    )
