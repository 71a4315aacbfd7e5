"""The autoscale policy on a fake clock: up only after the queue's wait stayed over target for
the delay, down only after the quiet window, one replica pending at a time, within bounds, and a
steady load at 1.5x one replica's capacity holds a steady count."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from serving.elastic.policy import Autoscaler, ScaleDecision, ScalePolicy, replica_rows

ROWS = 64.0  # what one replica holds in flight at full pace


def policy(low: int = 1, high: int = 4) -> ScalePolicy:
    return ScalePolicy(low, high, target_queue_wait_ms=50, upscale_delay_s=5, downscale_delay_s=60)


def sample(
    scaler: Autoscaler,
    now: float,
    *,
    wait_ms: float = 0.0,
    inflight: int = 0,
    healthy: int = 1,
    pending: int = 0,
    replicas: int | None = None,
) -> ScaleDecision:
    return scaler.observe(
        now,
        queue_wait_ms=wait_ms,
        inflight_rows=inflight,
        healthy=healthy,
        pending=pending,
        replicas=healthy + pending if replicas is None else replicas,
        replica_rows=ROWS,
    )


def test_up_once_the_wait_stayed_over_target_for_the_delay_not_before() -> None:
    scaler = Autoscaler(policy())
    decisions = [sample(scaler, t, wait_ms=80, inflight=60) for t in range(0, 6)]
    assert [d.direction for d in decisions] == ["", "", "", "", "", "up"]
    up = decisions[-1]
    assert (up.target, up.reason) == (2, "queue_wait")
    assert "queue wait 80 ms (target 50 ms) for 5 s" in up.detail


def test_a_dip_under_target_starts_the_delay_again() -> None:
    scaler = Autoscaler(policy())
    for t in range(4):
        assert sample(scaler, t, wait_ms=80).direction == ""
    assert sample(scaler, 4, wait_ms=10).direction == ""  # the backlog cleared for a moment
    assert [sample(scaler, t, wait_ms=80).direction for t in range(5, 11)] == [""] * 5 + ["up"]


def test_at_most_one_pending_and_a_new_replica_is_judged_on_the_load_it_meets() -> None:
    scaler = Autoscaler(policy())
    assert sample(scaler, 5, wait_ms=80).direction == ""
    assert sample(scaler, 10, wait_ms=80).direction == "up"
    # A node boots for a minute: the wait stays high, no second replica is asked for.
    for t in range(11, 70, 5):
        held = sample(scaler, t, wait_ms=300, healthy=1, pending=1)
        assert held.direction == ""
        assert "waiting for the replica starting" in held.detail or held.reason == ""
    # It serves: the backlog from before it must stay over target for a delay of its own.
    assert sample(scaler, 70, wait_ms=300, healthy=2).direction == ""
    assert sample(scaler, 74, wait_ms=300, healthy=2).direction == ""
    assert sample(scaler, 75, wait_ms=300, healthy=2).direction == "up"


def test_down_after_the_quiet_window_only() -> None:
    scaler = Autoscaler(policy())
    # 3 serve; the load fits in under half of what 2 deliver (64 rows of 128).
    decisions = {t: sample(scaler, t, wait_ms=5, inflight=40, healthy=3) for t in range(0, 61)}
    assert all(d.direction == "" for t, d in decisions.items() if t < 60)
    assert (decisions[60].direction, decisions[60].target, decisions[60].reason) == (
        "down",
        2,
        "low_load",
    )
    # The count changed: the window starts again.
    assert sample(scaler, 61, wait_ms=5, inflight=20, healthy=2).direction == ""
    assert sample(scaler, 121, wait_ms=5, inflight=20, healthy=2).direction == "down"


def test_no_down_while_the_replicas_left_would_be_over_half_busy() -> None:
    scaler = Autoscaler(policy())
    # 70 rows in flight on 3: 2 left would hold 70 of 128, over half.
    assert all(sample(scaler, t, inflight=70, healthy=3).direction == "" for t in range(0, 300))
    # Nothing measured yet and rows in flight: no down on a guess.
    blind = Autoscaler(policy())
    for t in range(0, 120):
        d = blind.observe(
            t,
            queue_wait_ms=0,
            inflight_rows=5,
            healthy=3,
            pending=0,
            replicas=3,
            replica_rows=None,
        )
        assert d.direction == ""


def test_an_unhealthy_replica_goes_first_so_the_healthy_ones_keep_their_load() -> None:
    scaler = Autoscaler(policy())
    # 2 healthy + 1 dead, 50 rows in flight: removing the dead one leaves 2 x 64, 39% busy.
    decisions = [sample(scaler, t, inflight=50, healthy=2, replicas=3) for t in range(0, 61)]
    assert decisions[-1].direction == "down"


def test_bounds_min_at_once_max_held() -> None:
    scaler = Autoscaler(policy(low=2, high=3))
    below = sample(scaler, 0, healthy=1)
    assert (below.direction, below.target, below.reason) == ("up", 2, "min_replicas")
    pending = sample(scaler, 1, healthy=1, pending=1, replicas=1)  # asked, not placed yet
    assert (pending.direction, pending.target) == ("", 2)
    at_max = Autoscaler(policy(low=1, high=2))
    for t in range(0, 30):
        d = sample(at_max, t, wait_ms=500, healthy=2)
        assert d.direction == ""
    assert (d.target, d.reason) == (2, "max_replicas")
    above = sample(Autoscaler(policy(low=1, high=2)), 0, healthy=3)
    assert (above.direction, above.target, above.reason) == ("down", 2, "max_replicas")
    # Never below the minimum however quiet.
    floor = Autoscaler(policy(low=2, high=4))
    assert all(sample(floor, t, healthy=2).direction == "" for t in range(0, 300))


@dataclass
class SteadyLoad:
    """A load of ``times`` one replica's capacity on a cluster where a new replica takes
    ``boot_s`` to serve; what the batcher would show at each healthy count."""

    times: float
    boot_s: float = 20.0
    healthy: int = 1
    pending_since: float | None = None

    def figures(self) -> tuple[float, int]:
        busy = self.times / self.healthy  # each replica's share of its capacity
        wait_ms = 400.0 if busy > 1 else 10.0 * busy  # over capacity the queue grows
        return wait_ms, int(min(busy, 1.0) * ROWS * self.healthy)


@pytest.mark.parametrize("times", [1.5, 2.5])
def test_a_steady_load_changes_the_count_once_and_holds_it(times: float) -> None:
    scaler, load = Autoscaler(policy(high=4)), SteadyLoad(times)
    counts = []
    for t in range(0, 600):
        if load.pending_since is not None and t - load.pending_since >= load.boot_s:
            load.healthy, load.pending_since = load.healthy + 1, None
        wait_ms, inflight = load.figures()
        pending = int(load.pending_since is not None)
        decision = sample(scaler, t, wait_ms=wait_ms, inflight=inflight, healthy=load.healthy,
                          pending=pending)  # fmt: skip
        assert decision.direction != "down"
        if decision.direction == "up":
            load.pending_since = t
        counts.append(load.healthy)
    changes = sum(1 for a, b in itertools.pairwise(counts) if a != b)
    assert load.healthy == int(times) + 1  # enough to carry it
    assert changes == int(times)  # one step per replica the load needed, then steady


def test_one_replicas_rows_follow_its_pipeline() -> None:
    # Two balanced stages: a 32-row batch takes 2 x 10 ms, one leaves every 10 ms.
    assert replica_rows(32, latency_s=0.020, bottleneck_s=0.010) == 64.0
    assert replica_rows(32, latency_s=None, bottleneck_s=None) is None
    with pytest.raises(ValueError, match=r"1 <= min_replicas <= max_replicas, got 3\.\.2"):
        ScalePolicy(3, 2)


def test_up_to_what_the_offered_load_needs_within_max() -> None:
    scaler = Autoscaler(policy(high=3))

    def up(demand: float | None) -> ScaleDecision:
        for t in range(6):
            decision = scaler.observe(
                float(t),
                queue_wait_ms=80,
                inflight_rows=60,
                healthy=1,
                pending=0,
                replicas=1,
                replica_rows=ROWS,
                demand=demand,
            )
        return decision

    assert (up(2.5).direction, scaler.policy.max_replicas) == ("up", 3)
    assert up(2.5).target == 3
    assert up(None).target == 2  # not measured: one more
    assert up(1.2).target == 2  # never fewer than one more
    assert up(7.0).target == 3  # never more than max_replicas
