"""``python -m bench soak``: the front end's memory under a long load stays flat (issue 32).

The front end freezes what its load left alive and collects its first generation less often
(``serving.version.collector``); this bench checks that memory stays bounded with it. One
shardserve server (``--workload``, 1 stage, max batch 64) under a closed loop of ``--clients``
wrk clients on TF-Serving JSON ``/predict`` (the route that allocates the most per request) for
``--duration-s`` (10 minutes by default), after ``--warmup-s``; the server process's RSS is
sampled every ``--sample-s``. The verdict compares the median RSS of the first and the last
fifth of the samples: **flat** when the last is at most ``--flat-mb`` above the first, else
**growing**, with the least-squares slope in MB per minute beside it. A leak climbs all along;
a high-water mark of buffers levels off in the first fifth.

``SHARDSERVE_GC_FREEZE=false`` in the bench's environment soaks the server without the frozen
heap and the raised threshold (the servers inherit the environment).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import options
from bench.load.loops import WRK_INSTALL_HINT, closed_loop, have_wrk
from bench.models.workloads import get_workload, save_workload
from bench.observe.procinfo import RssSampler, read_proc
from bench.observe.scrape import free_port
from bench.options import Progress
from bench.systems import ServerProcess, SystemConfig
from bench.systems.shardserve import shardserve_spec


@dataclass(frozen=True)
class SoakPlan:
    workload: str = "light"
    clients: int = 64
    duration_s: float = 600.0
    warmup_s: float = 10.0
    sample_s: float = 5.0
    flat_mb: float = 20.0
    max_batch_size: int = 64
    batch_timeout_ms: float = 5.0
    workdir: Path = Path(".bench/soak")

    def __post_init__(self) -> None:
        get_workload(self.workload)
        options.require(
            self, at_least_one=("clients",), positive=("duration_s", "sample_s", "flat_mb")
        )


def run(plan: SoakPlan, progress: Progress = options.say) -> dict[str, Any]:
    if not have_wrk():
        raise SystemExit(f"bench soak drives wrk; {WRK_INSTALL_HINT}")
    model = save_workload(plan.workload, plan.workdir)
    port = free_port()
    config = SystemConfig(model, port, plan.max_batch_size, plan.batch_timeout_ms)
    spec = shardserve_spec(config, 1, plan.workdir / "cache")
    log = plan.workdir / "logs" / f"soak-{plan.workload}.log"
    body = get_workload(plan.workload).request_body()
    progress(f"[soak] starting {spec.name} (log: {log})")
    with ServerProcess(spec, port, body, log) as server:
        if plan.warmup_s >= 1:  # wrk counts whole seconds
            closed_loop(server.url, body, plan.clients, plan.warmup_s, tool="wrk")
        start_mb = read_proc(server.pid).rss_mb
        progress(f"[soak] {plan.clients} clients for {plan.duration_s:g} s; RSS {start_mb:.0f} MB")
        tick = time.monotonic()
        with RssSampler(server.pid, plan.sample_s) as sampler:
            result = closed_loop(server.url, body, plan.clients, plan.duration_s, tool="wrk")
        elapsed = time.monotonic() - tick
        end = read_proc(server.pid)
    samples = sampler.samples
    verdict = judge(samples, elapsed, plan.flat_mb)
    progress(
        f"[soak] {result.rps:,.0f} req/s, errors {result.errors}; RSS {verdict['first_mb']:.0f} "
        f"-> {verdict['last_mb']:.0f} MB ({verdict['slope_mb_per_min']:+.2f} MB/min): "
        f"{verdict['verdict']}"
    )
    return {
        "plan": options.plan_json(plan),
        "load": result.to_json(),
        "rss_mb": samples,
        "sample_s": plan.sample_s,
        "elapsed_s": elapsed,
        "start_mb": start_mb,
        "peak_rss_mb": end.peak_rss_mb,
        **verdict,
    }


def judge(samples: list[float], elapsed_s: float, flat_mb: float) -> dict[str, Any]:
    """First and last fifth's median RSS, the slope (MB per minute, least squares over the
    samples spread evenly over ``elapsed_s``), and "flat" or "growing"."""
    if len(samples) < 2:
        return {"first_mb": float("nan"), "last_mb": float("nan"), "growth_mb": float("nan"),
                "slope_mb_per_min": float("nan"), "verdict": "too few samples"}  # fmt: skip
    fifth = max(1, len(samples) // 5)
    first, last = statistics.median(samples[:fifth]), statistics.median(samples[-fifth:])
    step_min = elapsed_s / 60 / (len(samples) - 1)
    times = [i * step_min for i in range(len(samples))]
    mean_t, mean_v = statistics.fmean(times), statistics.fmean(samples)
    spread = sum((t - mean_t) ** 2 for t in times)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in zip(times, samples, strict=True)) / spread
    return {
        "first_mb": first,
        "last_mb": last,
        "growth_mb": last - first,
        "slope_mb_per_min": slope,
        "verdict": "flat" if last - first <= flat_mb else "growing",
    }


def render(results: dict[str, Any]) -> str:
    plan, load = results["plan"], results["load"]
    return "\n".join(
        [
            f"Soak: {plan['workload']}, {plan['clients']} wrk clients on `/predict` for "
            f"{results['elapsed_s']:.0f} s, the front end's RSS every {results['sample_s']:g} s "
            f"({len(results['rss_mb'])} samples); flat = the last fifth's median at most "
            f"{plan['flat_mb']:g} MB above the first fifth's.",
            "",
            "| req/s | errors | RSS at start MB | first fifth MB | last fifth MB | growth MB "
            "| slope MB/min | peak MB | verdict |",
            "|" + "---|" * 9,
            f"| {load['rps']:,.0f} | {load['errors']} | {results['start_mb']:.0f} "
            f"| {results['first_mb']:.1f} | {results['last_mb']:.1f} "
            f"| {results['growth_mb']:+.1f} | {results['slope_mb_per_min']:+.2f} "
            f"| {results['peak_rss_mb']:.0f} | **{results['verdict']}** |",
            "",
        ]
    )


def add_parsers(sub: Any) -> None:
    about = "the front end's RSS under a long closed loop: flat or growing (needs wrk)"
    opts = options.suite(
        sub, "soak", about, out="docs/bench-soak", plan=SoakPlan, run=run, render=render
    )
    opts.own("--workload")
    opts.add("clients")
    opts.own("--duration-s", type=float, help="seconds of load (600: 10 minutes)")
    opts.add("warmup_s")
    opts.own("--sample-s", type=float, help="seconds between two RSS samples")
    opts.own("--flat-mb", type=float, help="growth in MB still called flat")
    opts.add("max_batch_size", "batch_timeout_ms", "workdir")
