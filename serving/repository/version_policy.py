"""Which versions of a model are served: the ``[versions]`` table of its ``config.toml``.

The semantics are Triton's ``version_policy`` and TF Serving's ``model_version_policy``:
``latest`` serves the ``n`` highest-numbered versions on disk, ``all`` every one, ``specific``
those listed that are on disk (a listed version that is not there is simply not served; the
manager reports it, see ``missing``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["PolicyName", "VersionPolicy"]

PolicyName = Literal["latest", "all", "specific"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


@dataclass(frozen=True)
class VersionPolicy:
    policy: PolicyName = "latest"
    n: int = 1
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # ValueError, not ConfigError: this module stays free of the settings import so that the
        # repository's import chain stays short; read_model_config names the file around it.
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (how many latest versions): {self.n!r}")
        bad = [v for v in self.versions if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"versions must be positive integers, got {list(self.versions)!r}")
        if self.policy == "specific" and not self.versions:
            raise ValueError('policy "specific" needs versions = [...], the versions to serve')
        if self.policy != "specific" and self.versions:
            raise ValueError(
                f'versions = {list(self.versions)} is only read with policy = "specific" '
                f"(got policy {self.policy!r})"
            )
        object.__setattr__(self, "versions", tuple(sorted(set(self.versions))))

    def select(self, available: Iterable[int]) -> list[int]:
        """The versions to serve out of ``available`` (the complete ones on disk), sorted."""
        have = sorted(set(available))
        if self.policy == "all":
            return have
        if self.policy == "latest":
            return have[-self.n :]
        wanted = set(self.versions)
        return [v for v in have if v in wanted]

    def missing(self, available: Iterable[int]) -> list[int]:
        """Versions a ``specific`` policy lists that are not in ``available``, sorted."""
        have = set(available)
        return [v for v in self.versions if v not in have]

    def describe(self) -> str:
        """One line for logs and the index: ``latest 2``, ``all``, ``specific [1, 3]``."""
        if self.policy == "latest":
            return f"latest {self.n}"
        if self.policy == "all":
            return "all"
        return f"specific {list(self.versions)}"
