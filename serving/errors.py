"""The exception tree. Every error a request can meet is one of these; ``app.py`` maps each
class to one HTTP status in one place. They are plain picklable exceptions (a message and simple
attributes) because some are raised inside Ray actors and cross a process boundary.

    ShardServeError
    ├── InvalidInputError        400  the body does not fit the model signature
    ├── PayloadTooLargeError     413  the body is over max_body_bytes
    ├── RequestTimeoutError      408  the body did not arrive within body_read_timeout_s (the
    │                                 connection is closed after the answer)
    ├── UnauthorizedError        401  admin route without a bearer token
    ├── ForbiddenError           403  admin route with the wrong bearer token
    ├── NotFoundError            404  unknown model name
    ├── ConflictError            409  the request does not fit the model's state now (no canary
    │                                 to promote or roll back)
    ├── QueueFullError           503  no room for the rows; carries retry_after_s
    ├── NotReadyError            503  model not loaded/warmed yet, shutting down, or no replica
    │   │                             healthy now (then with retry_after_s)
    │   ├── RecoveringError      503  ... and one is being brought back: the batcher holds the
    │   │                             rows for it (``serving.batching.hold``) instead
    │   └── BodyCutError         503  the server's stop reached its drain mark while the body
    │                                 was still arriving (the connection is closed after it)
    ├── DeadlineExceededError    504  the request's deadline passed before its rows were computed
    │   └── BatchAbandonedError  504  its batch ran past the watchdog's limit (on two replicas,
    │                                 or on the only healthy one): the model's doing, not the
    │                                 deadline's (a canary's judge counts it whatever the deadline)
    ├── ModelInputError          422  the model raised on this request's rows (isolated from its
    │                                 batch-mates, who get their answers)
    └── BatchFailedError         500  the model or its stage processes failed on the batch

``from_runner`` turns whatever a model runner raised into one of these: the runner's errors
(``shards.errors.RunError``) carry one-line reasons already; anything else is named by its type
and its first line, scrubbed; the whole of it goes to the log.
"""

from __future__ import annotations

import asyncio
import logging

from shards.errors import (
    ModelError,
    NoHealthyReplicaError,
    ReplicaRecoveringError,
    RunError,
    StageTimeoutError,
    one_line,
)

log = logging.getLogger("shardserve")


class ShardServeError(Exception):
    status_code = 500
    # Seconds a client should wait before trying again (the Retry-After header); None: no hint.
    retry_after_s: float | None = None
    # The answer ends its connection (``Connection: close``).
    closes_connection = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message,))


class InvalidInputError(ShardServeError):
    status_code = 400


class PayloadTooLargeError(ShardServeError):
    status_code = 413


class RequestTimeoutError(ShardServeError):
    status_code = 408
    # A body cut short leaves the connection mid-request: nothing more can be read from it.
    closes_connection = True


class UnauthorizedError(ShardServeError):
    status_code = 401


class ForbiddenError(ShardServeError):
    status_code = 403


class NotFoundError(ShardServeError):
    status_code = 404


class ConflictError(ShardServeError):
    status_code = 409


class QueueFullError(ShardServeError):
    status_code = 503
    retry_after_s: float

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.retry_after_s))


class NotReadyError(ShardServeError):
    status_code = 503

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.retry_after_s))


class RecoveringError(NotReadyError):
    """No replica serves and one is being brought back: ``back`` is done when one rejoins (with
    None) or its recovery failed (with why). ``suspect``: the batch was the oldest on the
    replica when a stage died (it may be what killed it)."""

    def __init__(
        self,
        message: str,
        retry_after_s: float | None = None,
        back: asyncio.Future[str | None] | None = None,
        suspect: bool = False,
    ) -> None:
        super().__init__(message, retry_after_s)
        self.back = back
        self.suspect = suspect


class BodyCutError(NotReadyError):
    """A body read cut by the server's stop: this server will not read the rest, another
    may (a load balancer retries a 503 elsewhere; a 408 would blame the client)."""

    # Mid-body: nothing more can be read from the connection.
    closes_connection = True


class DeadlineExceededError(ShardServeError):
    status_code = 504


class BatchAbandonedError(DeadlineExceededError):
    pass


class BatchFailedError(ShardServeError):
    status_code = 500


class ModelInputError(ShardServeError):
    status_code = 422


def from_runner(exc: BaseException, rows: int) -> ShardServeError:
    """The client-facing error for a batch of ``rows`` rows that ``run_batch`` failed with.

    A ``ModelInputError`` means the input may be to blame: the batcher then splits the batch to
    find the requests that trigger it. Its message is final once a single request is left.
    """
    if isinstance(exc, ShardServeError):
        return exc
    if isinstance(exc, ModelError):
        if exc.input_blamed:
            return ModelInputError(f"the model failed on this input: {exc.message}")
        return BatchFailedError(f"model failed on a batch of {rows} rows: {exc.message}")
    if isinstance(exc, StageTimeoutError):
        return BatchAbandonedError(f"the request's batch was abandoned: {exc.message}")
    if isinstance(exc, ReplicaRecoveringError):
        return RecoveringError(
            f"the model is unavailable: {exc.message}; retry shortly",
            exc.retry_after_s,
            back=exc.back,
            suspect=exc.suspect,
        )
    if isinstance(exc, NoHealthyReplicaError):
        return NotReadyError(
            f"the model is unavailable: {exc.message}; retry shortly", exc.retry_after_s
        )
    if isinstance(exc, RunError):
        return BatchFailedError(f"the request's batch was lost: {exc.message}")
    log.error("model runner failed on a batch of %d rows", rows, exc_info=exc)
    return BatchFailedError(f"model failed on a batch of {rows} rows: {one_line(exc)}")
