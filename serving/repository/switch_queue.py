"""A deeper queue for the versions that serve while another version of their model loads.

Loading a version (TensorFlow's import in each new actor, the weights, the warm-up) takes CPU
that the serving version's stages and the front end share on a small machine. A queue sized for
the steady pace (``max_queue_rows``: a few batches) fills in that stall and sheds 503s although
nothing is wrong: at 870 req/s on 2 cores a switch refused 250 requests with the default queue
(docs/benchmarks.md). So while a version of a model loads, the other versions of that model hold
``SWITCH_QUEUE_FACTOR`` times their queue rows; the requests wait a little longer for that while,
within their deadlines, instead of being refused. Their own rows come back once no version of
the model is loading. A queue the operator sized (``max_queue_rows``) is left as it is.

The version that loaded holds the deeper queue too from when it takes the traffic until the
versions it replaces have answered what they held: their backlog (up to the widened rows) runs on
the same cores as its first batches, and with its own rows it refused what arrived meanwhile
(a light switch at 650 req/s on 2 cores: 32 to 165 requests, every one in the 0.2 s before the
new version's first answer, issue 32). And a queue narrows only once it holds no more than its
own rows (``backlog_within_own``): narrowed over a backlog of 150 rows, it refused every request
until the backlog had drained.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.version.served import ServedModel

__all__ = [
    "SWITCH_QUEUE_FACTOR",
    "backlog_within_own",
    "narrow_queues",
    "widen_queue",
    "widen_queues",
]

SWITCH_QUEUE_FACTOR = 8
# How long a settled switch waits for the widened queues to come back within their own rows
# before it narrows them anyway (a load above capacity never drains).
BACKLOG_WAIT_S = 10.0
# A version's rows before and while widened are its own field (``ServedModel.queue_widened``,
# whose ``queue_factor`` the elastic limits read). Which loads are under way is the reconciler's
# (``serving.repository.reconciler``): it narrows once none of the model is.


def widen_queues(versions: Iterable[ServedModel], loading: ServedModel) -> None:
    """``loading`` begins to load: every other version of its model that serves holds more."""
    for model in versions:
        if model is not loading:
            widen_queue(model)


def widen_queue(model: ServedModel) -> None:
    """``model`` holds ``SWITCH_QUEUE_FACTOR`` times its queue rows until ``narrow_queues``:
    nothing where it has no batcher yet, is widened already, or its operator sized its queue."""
    batcher = model.batcher
    if model.queue_widened is not None or batcher is None:
        return
    if model.settings.max_queue_rows is not None:
        return  # the operator's size
    rows = batcher.settings.max_queue_rows
    widened = rows * SWITCH_QUEUE_FACTOR
    batcher.reconfigure(max_queue_rows=widened)
    model.queue_widened = (rows, widened)


def narrow_queues(versions: Iterable[ServedModel]) -> None:
    """No load of their model is under way any more: the versions' own rows."""
    for model in list(versions):
        rows, model.queue_widened = model.queue_widened, None
        batcher = model.batcher
        # Left as it is where something else set it since (the admin route, the scaling loop).
        if rows is not None and batcher is not None and batcher.settings.max_queue_rows == rows[1]:
            batcher.reconfigure(max_queue_rows=rows[0])


async def backlog_within_own(
    versions: Iterable[ServedModel], timeout_s: float = BACKLOG_WAIT_S
) -> None:
    """Until every widened version among ``versions`` queues no more than its own rows, or
    ``timeout_s`` has passed: what ``narrow_queues`` waits for."""
    widened = [m for m in versions if m.queue_widened is not None and m.batcher is not None]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and any(_over_own(m) for m in widened):
        await asyncio.sleep(0.02)


def _over_own(model: ServedModel) -> bool:
    own, batcher = model.queue_widened, model.batcher
    return own is not None and batcher is not None and batcher.queued_rows > own[0]
