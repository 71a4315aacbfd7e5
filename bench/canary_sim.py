"""``python -m bench.canary_sim``: whether a client can steer a canary's verdict (issue 37 item 7).

No server: the canary's controller (``serving.canary.controller.Rollout``: the split, the windows,
the judge at its own cadence) on a simulated clock. Unversioned requests arrive at ``rate`` per
second; the split sends each to the stable version or the canary; a request fails when the client
made it fail (``client_failures``: a share of all requests, an out-of-vocabulary id, a 422 the
judge counts on both sides) or, on the canary only, when the canary fails it by itself
(``canary_failures``). A run ends at a rollback, a promotion, or after ``windows`` windows.

Printed: out of ``--runs`` runs, the rollbacks and promotions of a canary that is a copy of its
stable under 50% client failures (the goal: no rollback), and the requests and seconds until a
canary failing 20% of requests by itself is rolled back, with and without the client's failures.
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
from dataclasses import dataclass

from serving.canary.config import CanaryConfig, PromoteMode, TrafficConfig
from serving.canary.controller import Rollout
from serving.metrics.series import Metrics

__all__ = ["Outcome", "Scenario", "run", "runs"]


@dataclass(frozen=True)
class Scenario:
    client_failures: float = 0.5
    canary_failures: float = 0.0
    rate: float = 50.0  # unversioned requests per second, both versions together
    weights: tuple[int, int] = (90, 10)
    window_s: float = 60.0
    min_requests: int = 100
    promote: PromoteMode = "manual"
    windows: int = 3  # how long a run lasts without a verdict


@dataclass(frozen=True)
class Outcome:
    state: str  # "canary" (held to the end), "rolled_back" or "stable" (promoted)
    seconds: float  # from the canary's start to the verdict, or the run's end
    requests: int  # unversioned requests until then, both versions


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(scenario: Scenario, seed: int) -> Outcome:
    """One canary's life under ``scenario``; ``seed`` draws the split and the failures."""
    clock, rng = _Clock(), random.Random(seed)
    rules = CanaryConfig(
        window_s=scenario.window_s, min_requests=scenario.min_requests, promote=scenario.promote
    )
    traffic = TrafficConfig(*scenario.weights, canary_rules=rules)
    rollout = Rollout(
        "m",
        "1",
        traffic,
        Metrics(),
        lambda _: None,
        on_due=lambda _: rollout.check(),
        clock=clock,
        rng=rng,
    )
    rollout.start_canary("2")
    gap = 1.0 / scenario.rate
    requests = 0
    end = scenario.windows * scenario.window_s
    while clock.now < end and rollout.state == "canary" and rollout.canary == "2":
        clock.now += gap
        requests += 1
        version = rollout.pick()
        failed = rng.random() < scenario.client_failures or (
            version == "2" and rng.random() < scenario.canary_failures
        )
        rollout.record(version, failed, 0.010)
    state = "stable" if rollout.canary is None else rollout.state
    return Outcome(state, clock.now, requests)


def runs(scenario: Scenario, n: int, first_seed: int = 0) -> list[Outcome]:
    return [run(scenario, first_seed + i) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.canary_sim", description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rate", type=float, default=50.0)
    args = parser.parse_args(argv)
    logging.getLogger("shardserve").setLevel(logging.ERROR)  # a rollback's WARNING per run
    copy = Scenario(rate=args.rate)
    modes: tuple[PromoteMode, PromoteMode] = ("manual", "auto")
    for promote in modes:
        out = runs(Scenario(rate=args.rate, promote=promote), args.runs)
        print(
            f"copy of stable, 50% client failures, promote={promote}: "
            f"{sum(o.state == 'rolled_back' for o in out)} of {args.runs} rolled back, "
            f"{sum(o.state == 'stable' for o in out)} promoted "
            f"({copy.windows} windows of {copy.window_s:.0f} s, {args.rate:g} req/s, 90/10)"
        )
    for client, promote in ((0.0, modes[0]), (0.5, modes[0]), (0.5, modes[1])):
        scenario = Scenario(
            client_failures=client, canary_failures=0.2, rate=args.rate, promote=promote
        )
        out = runs(scenario, args.runs, first_seed=1000)
        back = [o for o in out if o.state == "rolled_back"]
        median = (
            f"median {statistics.median(o.requests for o in back):.0f} requests "
            f"({statistics.median(o.seconds for o in back):.0f} s), "
            f"max {max(o.seconds for o in back):.0f} s"
            if back
            else "none"
        )
        print(
            f"canary failing 20% itself, {client:.0%} client failures, promote={promote}: "
            f"{len(back)} of {args.runs} rolled back, "
            f"{sum(o.state == 'stable' for o in out)} promoted; {median}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
