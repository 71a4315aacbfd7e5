"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
the other routes give the same error (``serving.errors``)."""

from __future__ import annotations

from typing import Any

import orjson

from serving.errors import InvalidInputError, ShardServeError
from serving.http.replies import JSON, Reply, log_failure, retry_after_seconds

__all__ = ["FieldError", "error_object", "openai_error_reply", "openai_unexpected_reply"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout",
    413: "invalid_request_error",
    422: "invalid_request_error",
    503: "server_error",
    504: "timeout",
}
_CODES = {404: "model_not_found", 503: "unavailable", 504: "deadline_exceeded"}


class FieldError(InvalidInputError):
    """A 400 about one field of the body: OpenAI's ``param``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def error_object(exc: ShardServeError) -> dict[str, Any]:
    status = exc.status_code
    return {
        "error": {
            "message": exc.message,
            "type": _TYPES.get(status, "server_error"),
            "param": getattr(exc, "param", None),
            "code": _CODES.get(status),
        }
    }


def openai_error_reply(exc: ShardServeError, rid: bytes) -> Reply:
    """``serving.http.replies.error_reply`` in OpenAI's shape: the same status and headers."""
    log_failure(rid.decode(), exc.status_code, exc.message)
    headers = []
    retry_after = retry_after_seconds(exc)
    if retry_after is not None:
        headers.append((b"retry-after", b"%d" % retry_after))
    if exc.closes_connection:
        headers.append((b"connection", b"close"))
    return exc.status_code, orjson.dumps(error_object(exc)), JSON, headers


def openai_unexpected_reply() -> Reply:
    error = ShardServeError("internal server error; see the server log")
    return 500, orjson.dumps(error_object(error)), JSON, []
