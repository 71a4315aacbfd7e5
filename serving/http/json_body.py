"""The small JSON bodies the admin routes change something with (batch settings, canary
weights): a whole number written as ``8.0`` read as the integer, and a refused body told in one
sentence per field at fault, the same way on every route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

__all__ = ["refusal", "whole"]


def whole(value: Any) -> Any:
    """JSON's 8.0 is the integer 8 (JSON Schema's ``integer`` says so too)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def refusal(exc: ValidationError, shape: str, reason: Callable[[str, ErrorDetails], str]) -> str:
    """Why a body was refused: not JSON, not the ``shape`` it must have, or ``reason`` of each
    field at fault, once per field (pydantic reports a field once per branch of a union)."""
    reasons: dict[str, str] = {}
    for error in exc.errors():
        if error["type"] == "json_invalid":
            return f"body is not valid JSON: {error['ctx']['error']}"
        if not error["loc"]:
            return f"body must be {shape}, got {error['input']!r:.80}"
        field = str(error["loc"][0])
        if field not in reasons:
            reasons[field] = reason(field, error)
    return "; ".join(reasons.values())
