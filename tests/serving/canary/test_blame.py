"""What counts against a version in its canary window: the model raising, a stage failing, a
hung batch, a deadline of the server's own; never a client's choice (a 4xx, a full queue,
leaving, a deadline it shortened)."""

from __future__ import annotations

import pytest

from serving.canary.blame import version_failed
from serving.errors import (
    BatchAbandonedError,
    BatchFailedError,
    DeadlineExceededError,
    InvalidInputError,
    ModelInputError,
    NotFoundError,
    NotReadyError,
    PayloadTooLargeError,
    QueueFullError,
)

CASES = [
    (200, None, False, False),
    (422, ModelInputError("the model failed on this input"), False, True),
    (500, BatchFailedError("model failed on a batch of 4 rows"), False, True),
    # The front end failing (a header it could not read, a bug): the same code serves both
    # versions, so a client that can trigger it cannot use it against either.
    (500, None, False, None),
    (500, ValueError("Exceeds the limit (4300 digits) for integer string conversion"), False, None),
    (503, NotReadyError("the model is unavailable: no healthy replica of 1"), False, True),
    (504, BatchAbandonedError("the request's batch was abandoned"), False, True),
    (504, DeadlineExceededError("the request's deadline passed in the queue"), True, True),
    # The client's doing: not counted either way.
    (504, DeadlineExceededError("the request's deadline passed in the queue"), False, None),
    (503, QueueFullError("queue full: 4 rows queued, max_queue_rows=4"), False, None),
    (400, InvalidInputError("input 'x' has shape (3,)"), False, None),
    (404, NotFoundError("model 'm' has no version '9'"), False, None),
    (413, PayloadTooLargeError("body of 9 bytes is over the limit of 8 bytes"), False, None),
    (499, None, False, None),
]


@pytest.mark.parametrize(("status", "error", "past_own_deadline", "failed"), CASES)
def test_only_what_the_version_did_counts(
    status: int, error: Exception | None, past_own_deadline: bool, failed: bool | None
) -> None:
    assert version_failed(status, error, past_own_deadline=past_own_deadline) is failed
