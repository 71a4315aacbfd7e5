"""The state machine of a served version: the transitions it allows, the ones it refuses, and the
rules for a load that ends while the version drains."""

from __future__ import annotations

import asyncio

import pytest

from serving.version.life import TRANSITIONS, IllegalTransition, Life, VersionState

S = VersionState


def test_every_state_is_listed_and_retired_is_the_end() -> None:
    assert set(TRANSITIONS) == set(VersionState)
    assert TRANSITIONS[S.RETIRED] == frozenset()
    # every state but RETIRED leads somewhere, and RETIRED is reachable from every state
    # that is not LOADING/WARMING/READY directly (those go through DRAINING or FAILED)
    assert S.RETIRED in TRANSITIONS[S.DRAINING] and S.RETIRED in TRANSITIONS[S.FAILED]


def test_the_life_of_a_version_that_serves_and_retires() -> None:
    life = Life("model 'm' version 1")
    assert life.state is S.LOADING and not life.served
    life.move(S.WARMING)
    life.move(S.READY)
    assert life.served and life.reason is None
    life.move(S.DRAINING, "model 'm' version 1 is being unloaded (replaced)")
    assert life.reason == "model 'm' version 1 is being unloaded (replaced)"
    life.move(S.RETIRED)
    assert (
        life.state is S.RETIRED
        and life.reason == "model 'm' version 1 is being unloaded (replaced)"
    )


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ((), S.READY),  # LOADING -> READY skips the warm-up
        ((S.WARMING, S.READY), S.LOADING),  # a READY version does not load again
        ((S.WARMING, S.READY), S.FAILED),  # a version that serves drains before it fails
        ((S.FAILED,), S.READY),  # a failed version is retired, then loaded anew
        ((S.DRAINING, S.RETIRED), S.READY),  # retired is the end
        ((S.DRAINING, S.RETIRED), S.FAILED),
    ],
)
def test_an_illegal_transition_raises_and_names_both_states(
    path: tuple[VersionState, ...], illegal: VersionState
) -> None:
    life = Life("model 'm' version 2")
    for step in path:
        life.move(step, "why" if step in (S.FAILED, S.DRAINING) else None)
    before = life.state
    with pytest.raises(IllegalTransition, match=f"version 2 cannot go from {before} to {illegal}"):
        life.move(illegal)
    assert life.state is before


def test_a_load_that_ends_while_the_version_drains_does_not_bring_it_back() -> None:
    life = Life("m")
    life.refuse("server is shutting down")
    life.advance(S.WARMING)
    life.advance(S.READY)
    assert life.state is S.DRAINING
    assert life.served  # its load completed: a request is told why it is refused, not "loading"
    assert life.reason == "server is shutting down"


def test_fail_keeps_the_first_reason_and_refuse_keeps_a_failure() -> None:
    life = Life("m")
    assert life.fail("cannot read the SavedModel")
    assert not life.fail("a later reason")
    life.refuse("unloaded")
    assert life.state is S.FAILED and life.reason == "cannot read the SavedModel"


async def test_until_wakes_on_the_state_it_waits_for() -> None:
    life = Life("m")
    waiter = asyncio.ensure_future(life.until(S.READY, S.FAILED))
    await asyncio.sleep(0)
    life.move(S.WARMING)
    await asyncio.sleep(0)
    assert not waiter.done()
    life.move(S.FAILED, "warm-up failed")
    assert await asyncio.wait_for(waiter, 1.0) is S.FAILED
