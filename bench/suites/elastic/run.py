"""``python -m bench elastic``: replicas that follow the load between a minimum and a maximum
(issue 22).

On a 2-core machine real compute cannot show scaling, so the stages simulate their device
(``--simulate-device-ms``, small batches, ``--cpus-per-shard`` 0.1): a replica adds capacity
without taking CPU. One server, ``--min-replicas``..``--max-replicas``, with a short
``--downscale-delay-s`` (the server's default is 60 s) so that the run stays short. One
replica's capacity is computed (``max_batch_size`` rows every ``simulate_device_ms``; one stage)
and checked by a short closed-loop run shorter than ``--upscale-delay-s``. Then one open-loop
load through the KServe V2 infer route (``bench.load.timeline``), ``/metrics`` sampled every
0.5 s (``bench.observe.sampler``):

- **low** ``--low-factor`` (0.5x) for ``--low-seconds``;
- **high** ``--high-factor`` (2.5x): the seconds until the p99 is back under ``--p99-target-ms``
  (2 s windows, failures counted as infinitely slow), goodput once scaled (target >= 0.9x the
  offered rate) and the 503 share (target <= 1%);
- **quiet** ``--quiet-factor`` (0.5x): replicas removed after the quiet window with 0 failed
  requests, and when (if) they are back at the minimum;
- **steady** ``--steady-factor`` (1.5x) for ``--steady-seconds`` (300 s): the replica count
  changes at most once.

``--quick`` shortens every duration left at its default (a few minutes in all).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import options
from bench.load import pyload, timeline
from bench.load.timeline import Step, step_bounds
from bench.models.versions import ensure_model, v2_bodies
from bench.observe.quiet import other_benches
from bench.observe.sampler import DEFAULT_PREFIXES, Sampler, scrape_series
from bench.observe.scrape import free_port, wait_idle
from bench.options import Progress
from bench.suites.elastic.check import replica_total, summarize_elastic
from bench.suites.elastic.report import render
from bench.suites.rollout.run import quick
from bench.systems import ServerProcess, SystemConfig
from bench.systems.shardserve import shardserve_spec

MODEL = "tokens"
READY_BODY = b'{"instances": [[1, 2, 3, 4]]}'


@dataclass(frozen=True)
class ElasticPlan:
    simulate_device_ms: float = 50.0
    max_batch_size: int = 4
    batch_timeout_ms: float = 5.0
    cpus_per_shard: float = 0.1
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_wait_ms: float = 50.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 10.0  # short for the bench (the server's default is 60 s)
    drain_timeout_s: float = 30.0
    low_factor: float = 0.5
    high_factor: float = 2.5
    quiet_factor: float = 0.5
    steady_factor: float = 1.5
    low_s: float = 20.0
    high_s: float = 60.0
    quiet_s: float = 60.0
    steady_s: float = 300.0
    p99_target_ms: float = 200.0
    window_s: float = 2.0
    capacity_s: float = 3.0
    bodies: int = 256
    request_timeout_s: float = 30.0
    seed: int = 0
    quick: bool = False
    port: int = 0
    workdir: Path = Path(".bench/elastic")

    def __post_init__(self) -> None:
        options.require(
            self,
            at_least_one=("max_batch_size", "min_replicas", "bodies"),
            positive=("simulate_device_ms", "cpus_per_shard", "low_factor", "high_factor"),
        )
        options.require(self, positive=("low_s", "high_s", "quiet_s", "p99_target_ms"))
        options.require(self, positive=("window_s", "capacity_s", "request_timeout_s"))
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"--max-replicas ({self.max_replicas}) must be >= --min-replicas "
                f"({self.min_replicas})"
            )


QUICK = {"low_s": 10.0, "high_s": 40.0, "quiet_s": 40.0, "steady_s": 60.0}


def replica_capacity(plan: ElasticPlan) -> float:
    """Rows per second of one replica of one stage: a full batch every simulated run."""
    return plan.max_batch_size * 1000.0 / plan.simulate_device_ms


def stages(plan: ElasticPlan, unit: float) -> dict[str, Step]:
    named = {
        "low": Step(plan.low_factor * unit, plan.low_s),
        "high": Step(plan.high_factor * unit, plan.high_s),
        "quiet": Step(plan.quiet_factor * unit, plan.quiet_s),
    }
    if plan.steady_s > 0:
        named["steady"] = Step(plan.steady_factor * unit, plan.steady_s)
    return named


def _spec(plan: ElasticPlan, model: Path, port: int) -> Any:
    config = SystemConfig(model, port, plan.max_batch_size, plan.batch_timeout_ms)
    config = replace(config, simulate_device_ms=plan.simulate_device_ms)
    flags = {
        "--model-name": MODEL,
        "--grpc-port": "0",
        "--cpus-per-shard": f"{plan.cpus_per_shard:g}",
        "--min-replicas": str(plan.min_replicas),
        "--max-replicas": str(plan.max_replicas),
        "--target-queue-wait-ms": f"{plan.target_queue_wait_ms:g}",
        "--upscale-delay-s": f"{plan.upscale_delay_s:g}",
        "--downscale-delay-s": f"{plan.downscale_delay_s:g}",
        "--drain-timeout-s": f"{plan.drain_timeout_s:g}",
    }
    return shardserve_spec(config, 1, plan.workdir / "cache", flags=flags)


def _wait_min(base: str, plan: ElasticPlan, progress: Progress) -> None:
    """Until the replicas are back at the minimum (the capacity check may have scaled up)."""
    deadline = time.monotonic() + plan.downscale_delay_s * plan.max_replicas + 60.0
    while time.monotonic() < deadline:
        try:
            series = scrape_series(base, DEFAULT_PREFIXES)
        except OSError:
            series = None
        if series is not None and replica_total(series) <= plan.min_replicas:
            return
        time.sleep(0.5)  # another process's state: no event to wait on
    progress("  (the replicas did not come back to the minimum before the steps)")


def run(plan: ElasticPlan, progress: Progress = print) -> dict[str, Any]:
    if plan.quick:
        plan = quick(plan, QUICK)
    model = Path(ensure_model(plan.workdir / "models", "light")["path"])
    port = plan.port or free_port()
    spec = _spec(plan, model, port)
    log = plan.workdir / "logs" / "elastic.log"
    bodies = v2_bodies(plan.bodies, plan.seed)
    computed = replica_capacity(plan)
    progress(f"[elastic] starting {spec.name} (log: {log}); one replica: {computed:.1f} rows/s")
    with ServerProcess(spec, port, READY_BODY, log) as server:
        base = server.url.rsplit("/", 1)[0]
        url = f"{base}/v2/models/{MODEL}/infer"
        clients = str(4 * plan.max_batch_size)
        measured = pyload.run(url, bodies, ["--concurrency", clients], plan.capacity_s).rps
        progress(f"  measured {measured:.1f} req/s by {clients} closed-loop clients")
        # A front end that cannot keep up with the computed figure makes the measured one the unit.
        unit = computed if measured >= 0.8 * computed else measured
        named = stages(plan, unit)
        steps = list(named.values())
        spans = dict(zip(named, step_bounds(steps), strict=True))
        wait_idle(base, 60.0, 0.2)
        _wait_min(base, plan, progress)
        progress(
            "  steps: "
            + ", ".join(f"{k} {s.rate:.1f}/s x {s.seconds:g} s" for k, s in named.items())
        )
        start = time.perf_counter() + 0.5
        with Sampler(base, start) as sampler:
            timed = timeline.run(url, bodies, steps, start=start, timeout_s=plan.request_timeout_s)
    results = summarize_elastic(
        timed.replies,
        sampler.samples,
        spans,
        {k: s.rate for k, s in named.items()},
        target_ms=plan.p99_target_ms,
        window_s=plan.window_s,
        minimum=plan.min_replicas,
    )
    return {
        "bench": "elastic",
        "plan": options.plan_json(plan),
        "other_benches": other_benches(),
        "capacity": {"computed_rps": computed, "measured_rps": measured, "unit_rps": unit},
        "stages": {
            k: {"rate": s.rate, "seconds": s.seconds, "span": spans[k]} for k, s in named.items()
        },
        "sampler_errors": sampler.errors,
        **results,
    }


def add_parsers(sub: Any) -> None:
    about = "replicas follow a load step between --min-replicas and --max-replicas (issue 22)"
    opts = options.suite(
        sub, "elastic", about, out="docs/bench-elastic", plan=ElasticPlan, run=run, render=render
    )
    opts.add("simulate_device_ms", "max_batch_size", "batch_timeout_ms")
    opts.own("--cpus-per-shard", type=float)
    opts.own("--min-replicas", type=int)
    opts.own("--max-replicas", type=int)
    opts.own("--target-queue-wait-ms", type=float)
    opts.own("--upscale-delay-s", type=float)
    opts.own("--downscale-delay-s", type=float, help="short here; the server's default is 60")
    opts.own("--drain-timeout-s", type=float)
    opts.own("--low-factor", type=float, help="x one replica's capacity")
    opts.own("--high-factor", type=float)
    opts.own("--quiet-factor", type=float, help="the load after the step down")
    opts.own("--steady-factor", type=float)
    opts.own("--low-seconds", dest="low_s", type=float)
    opts.own("--high-seconds", dest="high_s", type=float)
    opts.own("--quiet-seconds", dest="quiet_s", type=float)
    opts.own("--steady-seconds", dest="steady_s", type=float, help="0: no steady stage")
    opts.own("--p99-target-ms", type=float)
    opts.own("--window", dest="window_s", type=float, help="s of each p99 window")
    opts.add("capacity_s")
    opts.own("--bodies", type=int, help="distinct request bodies")
    opts.own("--request-timeout", dest="request_timeout_s", type=float)
    opts.own("--quick", action="store_true", help="every duration left at its default shorter")
    opts.add("seed", "port", "workdir")
