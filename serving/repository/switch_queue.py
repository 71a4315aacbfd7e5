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

from serving.elastic.limits import apply_limits

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
# The widening is a source of the version's batching limits (``ServedModel.limits.factor``),
# which ``serving.elastic.limits`` combines with the others and alone writes. Which loads are
# under way is the reconciler's (``serving.repository.reconciler``): it narrows once none of the
# model is.


def widen_queues(versions: Iterable[ServedModel], loading: ServedModel) -> None:
    """``loading`` begins to load: every other version of its model that serves holds more."""
    for model in versions:
        if model is not loading:
            widen_queue(model)


def widen_queue(model: ServedModel) -> None:
    """``model`` holds ``SWITCH_QUEUE_FACTOR`` times its queue rows until ``narrow_queues``:
    nothing where it has no batcher yet, is widened already, or its operator sized its queue."""
    if model.limits.factor != 1 or model.batcher is None:
        return
    if model.settings.max_queue_rows is not None:
        return  # the operator's size
    model.limits.factor = SWITCH_QUEUE_FACTOR
    apply_limits(model)


def narrow_queues(versions: Iterable[ServedModel]) -> None:
    """No load of their model is under way any more: the versions' own rows."""
    for model in list(versions):
        if model.limits.factor != 1:
            model.limits.factor = 1
            apply_limits(model)


async def backlog_within_own(
    versions: Iterable[ServedModel], timeout_s: float = BACKLOG_WAIT_S
) -> None:
    """Until every widened version among ``versions`` queues no more than its own rows, or
    ``timeout_s`` has passed: what ``narrow_queues`` waits for."""
    widened = [m for m in versions if m.queue_widened is not None]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and any(_over_own(m) for m in widened):
        await asyncio.sleep(0.02)


def _over_own(model: ServedModel) -> bool:
    own, batcher = model.queue_widened, model.batcher
    return own is not None and batcher is not None and batcher.queued_rows > own[0]
