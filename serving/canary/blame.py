"""Whether an answer counts for or against the version that gave it, in a canary's window.

Only what the version did counts: an answer, or a failure it caused (the model raising on the
input, a stage failing, a batch that hung, a deadline of the server's own that passed). What a
client chose does not: a 4xx, a full queue's 503, leaving before the answer, or a deadline it
shortened itself (``X-Request-Timeout-Ms``, V2's ``timeout``, a gRPC deadline) that passed.
Counted, those would let anyone roll a canary back, or fail the stable until a bad canary is
promoted, with requests of a 1 us deadline. The caller counts only the requests whose version
the server chose (a canary's split), never one that named its version or a label.
"""

from __future__ import annotations

from serving.errors import BatchAbandonedError, DeadlineExceededError, QueueFullError

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
        return True
    if status >= 400:
        return None
    return False
