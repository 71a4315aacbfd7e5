"""The request parameters both V2 transports read (HTTP's ``parameters`` object, gRPC's
``parameters`` map) beyond the tensors: Triton's ``timeout``."""

from __future__ import annotations

from serving.errors import InvalidInputError

__all__ = ["timeout_s"]


def timeout_s(micros: int) -> float:
    """Triton's ``timeout`` (an integer of microseconds) in seconds; a 400 unless positive: a
    deadline already past would only fail the request, and count against nothing."""
    if micros <= 0:
        raise InvalidInputError(
            f'parameter "timeout" must be a positive number of microseconds, got {micros}; '
            "leave it out for the server's deadline (request_timeout_ms)"
        )
    return micros / 1e6
