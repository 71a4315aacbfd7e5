"""When a model version should have one replica more or one fewer: the autoscale policy.

``decide`` is a pure function, as Ray Serve's ``autoscaling_policy.py`` is: from one
``Observation`` of the version (sampled about once a second by ``serving.elastic.steps``), the
policy's own ``PolicyState`` from the sample before (plain data), its ``ScalePolicy`` and ``now``
to a ``ScaleDecision`` and the state to keep for the next sample. ``Autoscaler`` only carries that
state from one sample to the next.

The observation is what the batcher knows: how long the queue's oldest row has waited beyond the
batch wait, the rows in flight, and what one replica delivers (the rows it holds in flight at full
pace, from the run-time model of compute: ``replica_rows``).

- Up: the queue's wait stays over ``target_queue_wait_ms`` for ``upscale_delay_s``, and no
  replica is still pending or starting. The target is one more, or what the offered load needs
  when the server measured it (``demand``, ``serving.elastic.demand``), so a step to 2.5x one
  replica's load asks for 3 at once; the steps place them one after another, never two pending
  placement at a time.
- Down, one at a time: the queue's wait stays under half the target and the rows in flight stay
  under half of what the replicas left would deliver, for ``downscale_delay_s``.
- Both windows start again whenever the healthy count changes: a new replica is judged on the
  load it meets, not on the backlog from before it served. With the thresholds apart (over the
  target up, under half of it down) a steady load holds a steady count.
- Within [min_replicas, max_replicas]: below the minimum (a replica given up) one is added at
  once; above the maximum one is removed at once.

Pure: no clock of its own (``now`` comes in), no asyncio, no HTTP, no Ray (an import-linter
contract says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "Autoscaler",
    "Observation",
    "PolicyState",
    "ScaleDecision",
    "ScalePolicy",
    "decide",
    "replica_rows",
]

Direction = Literal["up", "down", ""]
# What a replica left after a scale-down may be loaded to, as a share of what it delivers; the
# queue's wait must be under this share of the target too.
DOWN_SHARE = 0.5


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int = 1
    max_replicas: int = 1
    target_queue_wait_ms: float = 50.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"replica bounds must be 1 <= min_replicas <= max_replicas, got "
                f"{self.min_replicas}..{self.max_replicas}"
            )
        if self.target_queue_wait_ms <= 0:
            raise ValueError(f"target_queue_wait_ms must be > 0, got {self.target_queue_wait_ms}")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError(
                f"upscale_delay_s and downscale_delay_s must be >= 0, got "
                f"{self.upscale_delay_s} and {self.downscale_delay_s}"
            )


@dataclass(frozen=True)
class Observation:
    """One sample of a version: ``replicas``: every replica not draining (``pending``: those
    placed or starting, not yet serving, counted in it); ``healthy``: those in the rotation;
    ``replica_rows``: what one replica delivers, when measured; ``demand``: the replicas the
    offered load needs, when measured."""

    queue_wait_ms: float
    inflight_rows: int
    healthy: int
    pending: int
    replicas: int
    replica_rows: float | None
    demand: float | None = None


@dataclass(frozen=True)
class PolicyState:
    """What the policy keeps between samples: since when the queue's wait has been over target,
    since when the load has been under the down share, and the healthy count they were judged
    against (a change starts both windows again)."""

    over_since: float | None = None
    quiet_since: float | None = None
    healthy: int | None = None


@dataclass(frozen=True)
class ScaleDecision:
    """``target``: the replicas the version should have; ``direction``: add ("up") or remove
    ("down") one replica now, or "" (hold); ``reason``: the metric label (``queue_wait``,
    ``low_load``, ``min_replicas``, ``max_replicas``; "" when steady); ``detail``: one line, the
    figures compared."""

    target: int
    direction: Direction
    reason: str
    detail: str


def replica_rows(
    max_batch_size: int, latency_s: float | None, bottleneck_s: float | None
) -> float | None:
    """The rows one replica holds in flight at full pace: it answers a full batch every
    ``bottleneck_s`` (its slowest stage), each taking ``latency_s`` end to end (Little's law);
    ``None`` before anything is measured."""
    if latency_s is None or not bottleneck_s or bottleneck_s <= 0:
        return None
    return max_batch_size * max(1.0, latency_s / bottleneck_s)


def decide(
    seen: Observation, state: PolicyState, policy: ScalePolicy, now: float
) -> tuple[ScaleDecision, PolicyState]:
    """The decision for ``seen`` at ``now`` (monotonic seconds), and the state for the next
    sample."""
    p, replicas = policy, seen.replicas
    over_since, quiet_since = state.over_since, state.quiet_since
    if seen.healthy != state.healthy:  # new capacity: judge it on the load from now
        over_since = quiet_since = None
    over = seen.queue_wait_ms > p.target_queue_wait_ms
    over_since = _since(over_since, now) if over else None
    load = _load_left(seen.inflight_rows, seen.healthy, replicas, seen.replica_rows)
    quiet = seen.queue_wait_ms < DOWN_SHARE * p.target_queue_wait_ms and load < DOWN_SHARE
    quiet_since = _since(quiet_since, now) if quiet else None
    kept = PolicyState(over_since, quiet_since, seen.healthy)
    figures = f"queue wait {seen.queue_wait_ms:.0f} ms (target {p.target_queue_wait_ms:g} ms)"

    if replicas < p.min_replicas:
        below = f"{replicas} below min_replicas {p.min_replicas}"
        return _up(kept, seen.pending, "min_replicas", below, p.min_replicas)
    if replicas > p.max_replicas:
        return _down(kept, replicas, "max_replicas", f"{replicas} above max_replicas")
    if over_since is not None and now - over_since >= p.upscale_delay_s:
        held = f"{figures} for {now - over_since:.0f} s"
        if replicas >= p.max_replicas:
            return ScaleDecision(replicas, "", "max_replicas", f"{held}; at max_replicas"), kept
        need = replicas + 1
        if seen.demand is not None and seen.demand > need:
            need = math.ceil(seen.demand - 1e-9)
            held = f"{held}; the offered load needs {seen.demand:.1f} replicas"
        return _up(kept, seen.pending, "queue_wait", held, min(need, p.max_replicas))
    quiet_s = now - quiet_since if quiet_since is not None else -1.0
    if quiet_s >= p.downscale_delay_s and replicas > p.min_replicas:
        return _down(
            kept,
            replicas,
            "low_load",
            f"{figures}, in flight {load:.0%} of what {replicas - 1} replica(s) deliver, "
            f"for {quiet_s:.0f} s",
        )
    steady = f"{figures}; {seen.healthy} healthy of {replicas}"
    return ScaleDecision(replicas, "", "", steady), kept


class Autoscaler:
    """One version's decisions: ``decide`` with the state carried from the sample before;
    ``observe`` once per sample with a monotonic ``now``."""

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self.state = PolicyState()

    def observe(
        self,
        now: float,
        *,
        queue_wait_ms: float,
        inflight_rows: int,
        healthy: int,
        pending: int,
        replicas: int,
        replica_rows: float | None,
        demand: float | None = None,
    ) -> ScaleDecision:
        seen = Observation(
            queue_wait_ms, inflight_rows, healthy, pending, replicas, replica_rows, demand
        )
        decision, self.state = decide(seen, self.state, self.policy, now)
        return decision


def _load_left(inflight: int, healthy: int, replicas: int, per_replica: float | None) -> float:
    """The rows in flight as a share of what the replicas left after removing one deliver: one
    not serving (pending, starting, unhealthy) goes first, so then every healthy one stays.
    ``inf`` when it cannot be told (nothing measured yet, no replica would serve)."""
    if inflight <= 0:
        return 0.0
    left = healthy if replicas > healthy else healthy - 1
    if per_replica is None or left < 1:
        return float("inf")
    return inflight / (left * per_replica)


def _up(
    state: PolicyState, pending: int, reason: str, detail: str, target: int
) -> tuple[ScaleDecision, PolicyState]:
    if pending > 0:  # at most one replica pending at a time
        waiting = f"{detail}; waiting for the replica starting"
        return ScaleDecision(target, "", reason, waiting), state
    return ScaleDecision(target, "up", reason, detail), _windows_again(state)


def _down(
    state: PolicyState, replicas: int, reason: str, detail: str
) -> tuple[ScaleDecision, PolicyState]:
    return ScaleDecision(replicas - 1, "down", reason, detail), _windows_again(state)


def _windows_again(state: PolicyState) -> PolicyState:
    return replace(state, over_since=None, quiet_since=None)


def _since(start: float | None, now: float) -> float:
    return start if start is not None else now
