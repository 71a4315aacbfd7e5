"""Each setting's command-line flag, read by ``shardserve serve`` and by the settings reference
(``serving.settings.reference``), so that the two name the same flag."""

from __future__ import annotations

__all__ = ["NEGATABLE", "REPEATED", "REPEATED_METAVARS", "flag_name", "flags"]

# Settings whose flag is singular because it repeats: --import a --import b.
REPEATED = {"imports": "import", "pad_inputs": "pad-input"}
REPEATED_METAVARS = {"imports": "MODULE", "pad_inputs": "NAME=VALUE"}
# Settings with a --no- flag beside their own (unset, on, off).
NEGATABLE = ("pad_lengths", "tracing")


def flag_name(field: str) -> str:
    return "--" + REPEATED.get(field, field.replace("_", "-"))


def flags(field: str) -> tuple[str, ...]:
    """Every flag that sets ``field``: its own, and ``--no-...`` where it has one."""
    flag = flag_name(field)
    return (flag, f"--no-{flag[2:]}") if field in NEGATABLE else (flag,)
