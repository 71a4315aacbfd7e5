"""The reduced dtypes a stage may hold its weights in (``--weight-dtype``) or send its
activations in (``--activation-dtype``), and the check of a name given for one. Pure Python: the
planner, the pipeline's options and the stage actor read it."""

from __future__ import annotations

__all__ = ["REDUCED_DTYPES", "check_reduced"]

REDUCED_DTYPES = ("bfloat16", "float16")


def check_reduced(name: str | None, what: str) -> str | None:
    """None for off (None or "float32"); else one of ``REDUCED_DTYPES``."""
    if name in (None, "float32"):
        return None
    if name not in REDUCED_DTYPES:
        raise ValueError(f"{what} must be one of {('float32', *REDUCED_DTYPES)}, got {name!r}")
    return name
