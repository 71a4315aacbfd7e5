"""What went wrong with a batch, told apart at the ``shards`` boundary (how long a batch may run
is ``shards.pipeline.watchdog``'s).

Two kinds of failure need opposite answers. The model raising on a batch (``RayTaskError``) is
the batch's fault: the replica is fine, and retrying elsewhere would fail the same way. A stage
process dying or hanging is the replica's fault: the batch was never answered, so it is retried
once on another healthy replica (where there is one) while this one is recovered.
"""

from __future__ import annotations

import logging

from shards.errors import (
    INPUT_ERRORS,
    ModelError,
    ReplicaLostError,
    RunError,
    StageTimeoutError,
    one_line,
)

log = logging.getLogger(__name__)


def translate(exc: BaseException) -> RunError:
    """The one-line ``RunError`` for an exception out of a batch; the full detail is logged."""
    if isinstance(exc, RunError):
        return exc
    import ray.exceptions as rex

    if isinstance(exc, rex.RayTaskError):
        cause = exc.cause
        if isinstance(cause, RunError):
            # The stage said it in our own terms (shards.actor.stage_actor.ShardActor.forward).
            return cause
        if isinstance(cause, rex.RayError) and not isinstance(cause, rex.RayTaskError):
            return translate(cause)  # an upstream stage died: its error is passed down the chain
        root = cause if isinstance(cause, BaseException) else exc
        log.warning("the model raised on a batch:\n%s", exc)
        return ModelError(one_line(root), input_blamed=type(root).__name__ in INPUT_ERRORS)
    if isinstance(exc, TimeoutError) and not isinstance(exc, rex.RayError):
        return StageTimeoutError("the batch ran past the watchdog's limit")
    if isinstance(exc, rex.RayError):
        log.warning("a stage process failed under a batch: %s", exc)
        return ReplicaLostError(f"a stage process failed: {type(exc).__name__}")
    log.warning("a batch failed", exc_info=exc)
    return ModelError(one_line(exc), input_blamed=type(exc).__name__ in INPUT_ERRORS)


def is_replica_fault(error: RunError) -> bool:
    return isinstance(error, ReplicaLostError | StageTimeoutError)
