"""Whether an answer counts for or against the version that gave it, in a canary's window.

Only what the version did counts: an answer, or a failure it caused (the model raising on the
input, a stage failing, a batch that hung, a dead replica, a deadline of the server's own that
passed). What a client chose does not: a 4xx, a full queue's 503, leaving before the answer, or
a deadline it shortened itself (``X-Request-Timeout-Ms``, V2's ``timeout``, a gRPC deadline)
that passed. Counted, those would let anyone roll a canary back, or fail the stable until a bad
canary is promoted, with requests of a 1 us deadline. Nor does a 5xx that is not the version's
(an error outside the model runner: a header or a body the front end failed to read is the same
code for both versions). The caller counts only the requests whose version the server chose (a
canary's split), never one that named its version or a label.

The model raising on an input (422) counts, on both sides: a client that can make the model
raise (an out-of-vocabulary id) moves the stable's rate and the canary's alike, since the split
is a draw it cannot steer, and the judge's test sees only a difference; a canary that raises on
inputs the stable answers is that difference.
"""

from __future__ import annotations

from serving.errors import (
    BatchAbandonedError,
    DeadlineExceededError,
    QueueFullError,
    ShardServeError,
)

__all__ = ["CLIENT_GONE", "version_failed"]

CLIENT_GONE = 499  # nginx's status for a client that left before its answer
_MODEL_RAISED = 422  # ModelInputError: the model raised on the input


def version_failed(
    status: int, error: BaseException | None, *, past_own_deadline: bool
) -> bool | None:
    """``True``: the version failed the request; ``False``: it answered; ``None``: not the
    version's doing, not counted. ``past_own_deadline``: the server's own deadline for the
    request (``request_timeout_ms`` from its admission) had passed when it was answered."""
    if status == CLIENT_GONE or isinstance(error, QueueFullError):
        return None
    if isinstance(error, BatchAbandonedError):  # hung: whoever's deadline it was
        return True
    if isinstance(error, DeadlineExceededError):
        return True if past_own_deadline else None
    if status >= 500 or status == _MODEL_RAISED:
        # The version's errors are the tree's (``serving.errors.from_runner`` names whatever a
        # runner raised); anything else failed in the front end, before or after the version.
        return isinstance(error, ShardServeError) or None
    if status >= 400:
        return None
    return False
