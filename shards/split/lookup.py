"""How a table split by rows is joined (``lookup_combine``): the choices, the default and the
check of a value given. The one owner of the knob: the server's setting, ``shardserve partition``
and ``plan``'s flag and the planner all take these. Keras-free, and the one submodule of
``shards.split`` imported from outside it: the settings read it without the package's Keras
names.

- ``routed`` (the default): each part writes only the vectors of the ids in its range and
  their positions; the combine scatters them. What the parts write in all is the output once
  plus 4 bytes an id (0.52x the dense bytes at 2 parts, dim 32: docs/benchmarks.md); the memory
  plan counts a part at its worst case (every id of the batch in its range: the dense output
  plus the positions, +3% of a part's activations at dim 32, +0.2% of its planned peak on the
  demo recommender).
- ``dense``: each part writes the whole output, zeros outside its rows; the combine adds.
"""

from __future__ import annotations

from typing import Literal, get_args

from shards.errors import PlanError

__all__ = ["DEFAULT_LOOKUP_COMBINE", "LOOKUP_COMBINES", "LookupCombine", "check_lookup_combine"]

LookupCombine = Literal["routed", "dense"]
LOOKUP_COMBINES: tuple[str, ...] = get_args(LookupCombine)
DEFAULT_LOOKUP_COMBINE: LookupCombine = "routed"


def check_lookup_combine(value: str) -> LookupCombine:
    """``value`` when it is one of the choices; else a ``PlanError`` naming them."""
    if value not in LOOKUP_COMBINES:
        choices = " or ".join(repr(c) for c in LOOKUP_COMBINES)
        raise PlanError(f"lookup_combine is {choices}, got {value!r}")
    return value  # type: ignore[return-value]
