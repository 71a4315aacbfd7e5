"""The length-padding settings: rows of different lengths (along an input's unknown dimension)
padded to a length bucket so that they share a batch. A base of
``serving.settings.config.Settings``, so they come from the same flags, env vars and TOML
keys as every other setting (``Settings`` reads ``allowed_lengths`` as text with its other lists).

``pad_inputs`` is given as ``NAME=VALUE`` pairs (a repeatable ``--pad-input`` flag, a
comma-separated env var or a JSON object) or as a TOML table; each value an int, a float or
true/false.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from shards.partition.memory_plan import DEFAULT_MAX_SEQUENCE_LENGTH
from shards.signature import ModelSignature

__all__ = [
    "LengthSettings",
    "PadValue",
    "parse_pad_inputs",
    "parse_pad_value",
    "served_max_length",
]

PadValue = int | float | bool
# The largest --max-sequence-length taken (serving.settings.config).
MAX_LENGTH_LIMIT = 1_048_576


def served_max_length(requested: int | None, signature: ModelSignature) -> int:
    """The longest length a model is served up to along its unknown dimensions: the
    ``max_sequence_length`` asked for, else the model's own bound (``TensorSpec.max_length``),
    else the default (what the partitioner planned at). A length asked for over the bound is
    refused when the model loads (``serving.version.served``), so none is served here."""
    if requested is not None:
        return requested
    bound = signature.max_length
    return DEFAULT_MAX_SEQUENCE_LENGTH if bound is None else bound


class LengthSettings(BaseModel):
    pad_lengths: bool = Field(
        True,
        description="Rows of different lengths share a batch, padded to a length bucket, where "
        "the warm-up check finds it safe; false = one queue per length.",
    )
    allowed_lengths: Annotated[list[int] | None, NoDecode] = Field(
        None,
        description="Length buckets a batch is padded to (16,32,64,128); unset = powers of two "
        "from 16 below max_sequence_length, and max_sequence_length; those over the model's "
        "longest are dropped.",
    )
    pad_inputs: Annotated[dict[str, PadValue], NoDecode] = Field(
        default_factory=dict,
        description="Length-pad an input the model does not mask: NAME=VALUE, its pad value "
        "(int, float, true/false); kept only where the warm-up check finds answers unchanged.",
    )

    if TYPE_CHECKING:  # a field of Settings, which this is a base of
        max_sequence_length: int | None

    @field_validator("pad_inputs", mode="before")
    @classmethod
    def _pad_values(cls, value: Any) -> Any:
        return parse_pad_inputs(value)

    @model_validator(mode="after")
    def _lengths_within_max(self) -> LengthSettings:
        lengths = self.allowed_lengths
        if lengths is None:
            return self
        # Unset, the longest is the model's own bound, known once it loads: buckets over it
        # are dropped then (serving.batching.lengths.length_buckets).
        longest = self.max_sequence_length or MAX_LENGTH_LIMIT
        bad = [n for n in lengths if not 1 <= n <= longest]
        if bad or not lengths:
            raise ValueError(
                f"allowed_lengths must be lengths between 1 and max_sequence_length "
                f"({longest}), got {lengths}; out of range: {bad} (a longer bucket needs a "
                "longer --max-sequence-length)"
            )
        self.allowed_lengths = sorted(set(lengths))
        return self


def parse_pad_inputs(value: Any) -> dict[str, PadValue]:
    """``NAME=VALUE`` pairs (a list, or text: comma-separated or a JSON object) or a mapping."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("{") else text.split(",")
    if isinstance(value, dict):
        pairs = [(str(name), raw) for name, raw in value.items()]
    elif isinstance(value, list | tuple):
        parts = [part for entry in value for part in str(entry).split(",") if part.strip()]
        pairs = [_pair(part) for part in parts]
    else:
        raise ValueError(f"expected NAME=VALUE pairs or a table of them, got {value!r}")
    return {name: parse_pad_value(name, raw) for name, raw in pairs}


def _pair(item: str) -> tuple[str, str]:
    name, sep, raw = item.partition("=")
    if not sep or not name.strip() or not raw.strip():
        raise ValueError(f"expected NAME=VALUE (an input's name and its pad value), got {item!r}")
    return name.strip(), raw.strip()


def parse_pad_value(name: str, raw: Any) -> PadValue:
    """An int, a float or a bool, from itself or from text (``0``, ``-1``, ``0.5``, ``false``)."""
    if isinstance(raw, bool | int):
        return raw
    if isinstance(raw, float) and math.isfinite(raw):
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if math.isfinite(number):
            return number
    raise ValueError(
        f"the pad value of input {name!r} must be an int, a finite float or true/false, got {raw!r}"
    )
