"""A client that can make any request fail (an out-of-vocabulary id: a 422 the judge counts on
both sides) against the canary's controller on a simulated clock (``bench.canary_sim``, no
server): it cannot roll back a canary that is a copy of its stable, and a canary that fails 20%
of requests by itself is still rolled back, within its window when the client does nothing."""

from __future__ import annotations

from bench.canary_sim import Scenario, runs

RUNS = 20


def test_half_of_all_requests_failing_rolls_back_no_copy_of_the_stable() -> None:
    # Raw rates against a fixed margin rolled back 16 of 20 such canaries (issue 37).
    outcomes = runs(Scenario(client_failures=0.5, canary_failures=0.0), RUNS)
    assert [o.state for o in outcomes] == ["canary"] * RUNS  # three windows, no verdict


def test_a_canary_failing_a_fifth_of_requests_is_rolled_back_within_its_window() -> None:
    scenario = Scenario(client_failures=0.0, canary_failures=0.2)
    outcomes = runs(scenario, RUNS, first_seed=1000)
    assert {o.state for o in outcomes} == {"rolled_back"}
    assert max(o.seconds for o in outcomes) < scenario.window_s


def test_the_clients_failures_slow_a_rollback_but_do_not_carry_a_broken_canary_through() -> None:
    scenario = Scenario(client_failures=0.5, canary_failures=0.2, promote="auto")
    outcomes = runs(scenario, RUNS, first_seed=1000)
    assert sum(o.state == "rolled_back" for o in outcomes) >= 15
    assert sum(o.state == "stable" for o in outcomes) <= 1
