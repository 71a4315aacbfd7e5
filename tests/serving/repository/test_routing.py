"""Which version answers a request that names none (serving.repository.routing.route)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.repository.routing import route


@dataclass
class Version:
    """What route reads of a served version: its number and why it would refuse (counted)."""

    version: str
    refuses: str | None = None
    asked: int = 0

    @property
    def available(self) -> bool:
        self.asked += 1
        return self.refuses is None


def versions(*served: Version) -> dict[str, Any]:
    return {v.version: v for v in served}


def test_a_lone_version_is_routed_to_without_asking_its_condition() -> None:
    # Every request is routed twice (the protocol's look from the headers, the data plane's):
    # a version's condition asks its replicas' health, which a lone version's pick never needs.
    lone = Version("1")
    assert route(versions(lone), None) is lone
    assert route(versions(lone), None, turn=False) is lone
    assert lone.asked == 0


def test_a_lone_version_that_refuses_is_still_the_one_routed_to() -> None:
    lone = Version("3", refuses="model is still loading")
    assert route(versions(lone), None) is lone  # it answers 503 with its reason


def test_the_highest_version_that_serves_is_picked_else_the_highest() -> None:
    one, two, ten = Version("1"), Version("2"), Version("10", refuses="model is still loading")
    assert route(versions(one, two, ten), None) is two
    two.refuses = "no healthy replica of 1; rebuilding"
    assert route(versions(one, two, ten), None) is one
    one.refuses = "model is draining"
    assert route(versions(one, two, ten), None) is ten
