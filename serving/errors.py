"""The exception tree. Every error a request can meet is one of these; ``app.py`` maps each
class to one HTTP status in one place. They are plain picklable exceptions (a message and simple
attributes) because some are raised inside Ray actors and cross a process boundary.

    ShardServeError
    ├── InvalidInputError        400  the body does not fit the model signature
    ├── PayloadTooLargeError     413  the body is over max_body_bytes
    ├── UnauthorizedError        401  admin route without a bearer token
    ├── ForbiddenError           403  admin route with the wrong bearer token
    ├── NotFoundError            404  unknown model name
    ├── QueueFullError           503  no room for the rows; carries retry_after_s
    ├── NotReadyError            503  model not loaded/warmed yet, or shutting down
    ├── DeadlineExceededError    504  the request's deadline passed before its rows were computed
    └── BatchFailedError         500  the model failed on the batch holding the request's rows
"""

from __future__ import annotations


class ShardServeError(Exception):
    status_code = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message,))


class InvalidInputError(ShardServeError):
    status_code = 400


class PayloadTooLargeError(ShardServeError):
    status_code = 413


class UnauthorizedError(ShardServeError):
    status_code = 401


class ForbiddenError(ShardServeError):
    status_code = 403


class NotFoundError(ShardServeError):
    status_code = 404


class QueueFullError(ShardServeError):
    status_code = 503

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.message, self.retry_after_s))


class NotReadyError(ShardServeError):
    status_code = 503


class DeadlineExceededError(ShardServeError):
    status_code = 504


class BatchFailedError(ShardServeError):
    status_code = 500
