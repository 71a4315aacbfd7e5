"""A deeper queue for the versions that serve while another version of their model loads.

Loading a version (TensorFlow's import in each new actor, the weights, the warm-up) takes CPU
that the serving version's stages and the front end share on a small machine. A queue sized for
the steady pace (``max_queue_rows``: a few batches) fills in that stall and sheds 503s although
nothing is wrong: at 870 req/s on 2 cores a switch refused 250 requests with the default queue
(docs/benchmarks.md). So while a version of a model loads, the other versions of that model hold
``SWITCH_QUEUE_FACTOR`` times their queue rows; the requests wait a little longer for that while,
within their deadlines, instead of being refused. Their own rows come back once no version of
the model is loading. A queue the operator sized (``max_queue_rows``) is left as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.version.served import ServedModel

__all__ = ["SWITCH_QUEUE_FACTOR", "narrow_queues", "widen_queues"]

SWITCH_QUEUE_FACTOR = 8
# A version's rows before and while widened are its own field (``ServedModel.queue_widened``,
# whose ``queue_factor`` the elastic limits read). Which loads are under way is the reconciler's
# (``serving.repository.reconciler``): it narrows once none of the model is.


def widen_queues(versions: Iterable[ServedModel], loading: ServedModel) -> None:
    """``loading`` begins to load: every other version of its model that serves holds more."""
    for model in versions:
        batcher = model.batcher
        if model is loading or model.queue_widened is not None or batcher is None:
            continue
        if model.settings.max_queue_rows is not None:
            continue  # the operator's size
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
