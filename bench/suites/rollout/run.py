"""``python -m bench rollout``: a new version under load, and canaries that roll back on their
own (issue 21).

Each part runs a server of its own on a model repository (``--model-repository``, polled every
second), model ``tokens`` (``bench.models.versions``: one signature, several kinds), and drives
it open loop through the KServe V2 infer route, whose answers name the version that ran them
(``bench.load.timeline``); ``/metrics`` is sampled every 0.5 s (``bench.observe.sampler``).

1. **switch** (per ``--switch-models``, real compute): capacity measured first (closed loop,
   ``--capacity-clients``), then ``--real-factor`` x capacity until ``--after`` seconds past
   version 1 unloaded (at most ``--switch-seconds``); version 2 (the same kind) is copied in at
   ``--appear-at`` (hidden directory, then a rename). Failed
   requests (target 0), answers from version 1 after the first answer of version 2 (target 0),
   the time from the rename to the first version 2 answer and to version 1 unloaded.
2. **simulated**: the same switch with ``simulate_device_ms`` and a small ``cpus_per_shard`` in
   the model's ``config.toml`` (loading TensorFlow does not take the cores the load needs), at
   ``--simulated-factor`` x capacity: p99 during the switch over p99 before it (target <= 1.5).
3. **canary** (per ``--canaries``): ``[traffic]`` 90/10 and a short ``[canary]`` window; a
   broken version (raises on 99% of the rows) must be rolled back on errors within its window,
   failing at most the canary's share of that window's requests; a slow one (``--slow-layers``
   Conv2D layers) on latency. Reported: the time to the rollback and the reason it was counted
   under in ``shardserve_rollbacks_total``.

``--quick`` shortens every duration left at its default (a few minutes in all).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from bench import options
from bench.models.versions import KINDS
from bench.observe.quiet import other_benches
from bench.options import Progress
from bench.suites.rollout.canary import run_canary
from bench.suites.rollout.report import render
from bench.suites.rollout.switch import run_switch

PARTS = ("switch", "simulated", "canary")
CANARIES = ("broken", "slow")


@dataclass(frozen=True)
class RolloutPlan:
    parts: tuple[str, ...] = PARTS
    switch_models: tuple[str, ...] = ("light", "heavy")
    real_factor: float = 0.5
    # A fixed rate for the real switches instead of real_factor x capacity: to compare two
    # configurations (their capacities differ) at the same load.
    real_rate: float | None = None
    simulated_factor: float = 0.9
    simulate_device_ms: float = 40.0
    simulated_batch: int = 8
    simulated_cpus_per_shard: float = 0.25
    max_batch_size: int = 8
    batch_timeout_ms: float = 5.0
    capacity_clients: int = 32
    capacity_s: float = 8.0
    switch_s: float = 120.0  # at most: the load ends after_s past version 1 unloaded
    appear_at_s: float = 10.0
    after_s: float = 5.0  # of load past version 1 unloaded, or past a canary's rollback
    unload_timeout_s: float = 120.0
    canaries: tuple[str, ...] = CANARIES
    canary_percent: int = 10
    canary_rate: float = 40.0
    canary_s: float = 90.0  # at most: the load ends after_s past the rollback
    canary_at_s: float = 5.0
    window_s: float = 15.0
    min_requests: int = 30
    slow_layers: int = 160  # ~5x the stable's p99 end to end (40 layers: ~2x, within the bound)
    bodies: int = 256
    request_timeout_s: float = 30.0
    seed: int = 0
    quick: bool = False
    workdir: Path = Path(".bench/rollout")

    def __post_init__(self) -> None:
        options.require(
            self,
            at_least_one=("simulated_batch", "max_batch_size", "capacity_clients", "bodies"),
            positive=("real_factor", "simulated_factor", "simulate_device_ms", "capacity_s"),
        )
        options.require(self, positive=("switch_s", "canary_s", "canary_rate", "window_s"))
        options.require(self, positive=("after_s",))
        if self.real_rate is not None and self.real_rate <= 0:
            raise ValueError(f"--real-rate must be > 0, got {self.real_rate:g}")
        options.require(self, at_least_one=("min_requests", "slow_layers"))
        _known("parts", self.parts, PARTS)
        _known("switch_models", self.switch_models, KINDS[:2])
        _known("canaries", self.canaries, CANARIES)
        if not 0 < self.canary_percent < 100:
            raise ValueError(f"canary_percent must be in 1..99, got {self.canary_percent}")
        if not 0 < self.appear_at_s < self.switch_s:
            raise ValueError(
                f"--appear-at must fall inside the load (0, {self.switch_s:g}), got "
                f"{self.appear_at_s:g}"
            )
        if not 0 < self.canary_at_s < self.canary_s:
            raise ValueError(
                f"--canary-at must fall inside the load (0, {self.canary_s:g}), got "
                f"{self.canary_at_s:g}"
            )


def _known(name: str, given: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    unknown = [g for g in given if g not in allowed]
    if unknown or not given:
        raise ValueError(f"{name} must be some of {', '.join(allowed)}; got {list(given)}")


# --quick: each of these that is still at its default.
QUICK = {
    "capacity_s": 3.0,
    "switch_s": 60.0,
    "appear_at_s": 5.0,
    "canary_s": 60.0,
    "canary_at_s": 3.0,
    "window_s": 8.0,
    "min_requests": 10,
    "slow_layers": 120,
}


def quick(plan: Any, shorter: dict[str, Any]) -> Any:
    """``plan`` with each field of ``shorter`` still at its default replaced."""
    defaults = {f.name: f.default for f in fields(plan)}
    return replace(plan, **{k: v for k, v in shorter.items() if getattr(plan, k) == defaults[k]})


def run(plan: RolloutPlan, progress: Progress = print) -> dict[str, Any]:
    if plan.quick:
        plan = quick(plan, QUICK)
    results: dict[str, Any] = {
        "bench": "rollout",
        "plan": options.plan_json(plan),
        "other_benches": other_benches(),
        "switch": [],
        "canary": [],
    }
    if "switch" in plan.parts:
        for kind in plan.switch_models:
            results["switch"].append(run_switch(plan, kind, kind, False, progress))
    if "simulated" in plan.parts:
        results["switch"].append(run_switch(plan, "simulated", "light", True, progress))
    if "canary" in plan.parts:
        for kind in plan.canaries:
            results["canary"].append(run_canary(plan, kind, progress))
    return results


def add_parsers(sub: Any) -> None:
    about = "a version switch under load, and canaries rolled back on their own (issue 21)"
    opts = options.suite(
        sub, "rollout", about, out="docs/bench-rollout", plan=RolloutPlan, run=run, render=render
    )
    opts.own("--parts", type=options.csv, help=f"comma-separated, of {', '.join(PARTS)}")
    opts.own("--switch-models", type=options.csv, help="comma-separated: light,heavy")
    opts.own("--real-factor", type=float, help="the switch's load, x capacity")
    opts.own("--real-rate", type=float, help="the switch's load in req/s (not x capacity)")
    opts.own("--simulated-factor", type=float, help="the simulated switch's load, x capacity")
    opts.add("simulate_device_ms")
    opts.own("--simulated-batch", type=int, help="max_batch_size of the simulated switch")
    opts.own("--simulated-cpus-per-shard", type=float)
    opts.add("max_batch_size", "batch_timeout_ms", "capacity_clients", "capacity_s")
    opts.own("--switch-seconds", dest="switch_s", type=float)
    opts.own("--appear-at", dest="appear_at_s", type=float, help="s into the switch's load")
    opts.own("--after", dest="after_s", type=float, help="s of load past the switch/rollback")
    opts.own("--unload-timeout", dest="unload_timeout_s", type=float)
    opts.own("--canaries", type=options.csv, help="comma-separated: broken,slow")
    opts.own("--canary-percent", type=int)
    opts.own("--canary-rate", type=float, help="req/s of the canary runs")
    opts.own("--canary-seconds", dest="canary_s", type=float)
    opts.own("--canary-at", dest="canary_at_s", type=float, help="s into the canary's load")
    opts.own("--window", dest="window_s", type=float, help="the canary's window_s")
    opts.own("--min-requests", type=int, help="the canary's min_requests")
    opts.own("--slow-layers", type=int, help="Conv2D layers of the slow canary")
    opts.own("--bodies", type=int, help="distinct request bodies")
    opts.own("--request-timeout", dest="request_timeout_s", type=float)
    opts.own("--quick", action="store_true", help="every duration left at its default shorter")
    opts.add("seed", "workdir")
