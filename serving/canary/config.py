"""How a model's traffic is split between its stable version and a canary: the ``[traffic]`` and
``[canary]`` tables of its ``config.toml``::

    [traffic]
    stable = 90            # weights: the share of unversioned requests each role takes
    canary = 10
    [canary]
    window_s = 60          # the sliding window both versions are judged over
    min_requests = 100     # no decision on fewer canary requests in the window
    error_margin = 0.02    # canary failure rate may exceed stable's by at most this
    alpha = 0.01           # chance a canary within the margin is ever rolled back on errors
    latency_factor = 2.0   # canary p99 <= max(latency_factor x stable p99, stable p99 + 50 ms)
    promote = "manual"     # or "auto": a canary that held for a whole window becomes stable

The judging itself is ``serving.canary``; this module only reads and checks the values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeGuard, get_args

# Not serving.settings.config: its import chain is long, and this module sits under serving.canary.
from serving.settings.sources import ConfigError

__all__ = [
    "LATENCY_SLACK_S",
    "PROMOTE_MODES",
    "CanaryConfig",
    "PromoteMode",
    "TrafficConfig",
    "check_weights",
    "read_traffic",
]

PromoteMode = Literal["manual", "auto"]
PROMOTE_MODES: tuple[str, ...] = get_args(PromoteMode)
# A canary's p99 may be at most max(latency_factor x stable p99, stable p99 + this): with a fast
# stable (a 5 ms p99), a factor alone would roll a canary back over a few ms of noise.
LATENCY_SLACK_S = 0.050


@dataclass(frozen=True)
class CanaryConfig:
    window_s: float = 60.0
    min_requests: int = 100
    error_margin: float = 0.02
    alpha: float = 0.01
    latency_factor: float = 2.0
    promote: PromoteMode = "manual"

    def __post_init__(self) -> None:
        # ValueError naming the key: read_traffic names the file and table around it, and the
        # admin API the request's field.
        if not _number(self.window_s) or self.window_s <= 0:
            raise ValueError(f"window_s must be a number of seconds > 0, got {self.window_s!r}")
        if not _integer(self.min_requests) or self.min_requests < 1:
            raise ValueError(
                "min_requests must be an integer >= 1 (canary requests in the window before "
                f"any decision), got {self.min_requests!r}"
            )
        if not _number(self.error_margin) or not 0 <= self.error_margin <= 1:
            raise ValueError(
                "error_margin must be a number from 0 to 1 (a failure rate, 0.02 = 2 points), "
                f"got {self.error_margin!r}"
            )
        if not _number(self.alpha) or not 0 < self.alpha < 1:
            raise ValueError(
                "alpha must be a number between 0 and 1 (the chance that a canary no worse than "
                f"stable + error_margin is rolled back on errors), got {self.alpha!r}"
            )
        if not _number(self.latency_factor) or self.latency_factor < 1:
            raise ValueError(
                "latency_factor must be a number >= 1 (canary p99 / stable p99), "
                f"got {self.latency_factor!r}"
            )
        if self.promote not in PROMOTE_MODES:
            raise ValueError(f"promote must be one of {list(PROMOTE_MODES)}, got {self.promote!r}")


@dataclass(frozen=True)
class TrafficConfig:
    stable: int = 100
    canary: int = 0
    canary_rules: CanaryConfig = field(default_factory=CanaryConfig)

    def __post_init__(self) -> None:
        check_weights(self.stable, self.canary)


def check_weights(stable: object, canary: object) -> None:
    """``ValueError`` naming the bad weight, unless both are integers >= 0 with a positive sum."""
    for key, value in (("stable", stable), ("canary", canary)):
        if not _integer(value) or value < 0:
            raise ValueError(f"{key} must be an integer weight >= 0, got {value!r}")
    if stable == 0 and canary == 0:
        raise ValueError("stable and canary are both 0: at least one weight must be > 0")


_TRAFFIC_KEYS = ("stable", "canary")
_CANARY_KEYS = tuple(f.name for f in fields(CanaryConfig))


def read_traffic(tables: dict[str, Any], where: str) -> TrafficConfig | None:
    """The ``traffic`` and ``canary`` tables of a ``config.toml`` (``where`` names the file,
    e.g. ``resnet/config.toml``); ``None`` when neither is there. Every failure is a one-line
    ``ConfigError`` naming the file, the key and what is allowed."""
    traffic = tables.get("traffic")
    canary = tables.get("canary")
    if traffic is None and canary is None:
        return None
    if traffic is None:
        raise ConfigError(
            f"{where}: [canary] needs a [traffic] table (e.g. stable = 90, canary = 10): the "
            "canary rules judge a canary that takes a share of the traffic"
        )
    values = _table(traffic, "traffic", _TRAFFIC_KEYS, where)
    rules = _table({} if canary is None else canary, "canary", _CANARY_KEYS, where)
    try:
        canary_rules = CanaryConfig(**rules)
    except ValueError as exc:
        raise ConfigError(f"{where}: [canary] {exc}") from None
    try:
        return TrafficConfig(**values, canary_rules=canary_rules)
    except ValueError as exc:
        raise ConfigError(f"{where}: [traffic] {exc}") from None


def _table(table: Any, name: str, allowed: tuple[str, ...], where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: {name} must be a table ([{name}]), got {table!r}")
    values = {str(k).replace("-", "_"): v for k, v in table.items()}
    unknown = [k for k in table if str(k).replace("-", "_") not in allowed]
    if unknown:
        raise ConfigError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))} in [{name}]; allowed: {list(allowed)}"
        )
    return values


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> TypeGuard[float]:
    # TOML has inf and nan: neither is a window, a margin or a factor.
    return (_integer(value) or isinstance(value, float)) and math.isfinite(value)
