"""The rollout bench's version switch: version 2 copied into the repository under a steady
open-loop load on version 1, and what the clients saw.

Measured (``summarize_switch``, pure): failed requests (all of them, the target is 0), answers
from version 1 to requests sent after the first answer from version 2 came back (the traffic
had moved: target 0), the time from "version 2 appears" (the rename) to its first answer and to
version 1 unloaded (its series gone from ``/metrics``), and the latency before the switch, during
it (from the rename to version 1 unloaded) and after.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.load import timeline
from bench.load.replies import (
    answers_after,
    by_version,
    failures,
    first_answer_s,
    summarize,
)
from bench.load.timeline import Action, Reply, Step
from bench.models.versions import ensure_model, v2_bodies
from bench.observe.sampler import Sample, Sampler, first_at, label_values
from bench.observe.scrape import wait_idle
from bench.options import Progress
from bench.suites.rollout.server import (
    Repository,
    base,
    capacity,
    config_toml,
    index,
    infer_url,
    server,
)

REPLICAS = "shardserve_replicas"


def serves(sample: Sample, version: str) -> bool:
    return version in label_values(sample.series, REPLICAS, "version")


def run_switch(plan: Any, label: str, kind: str, simulated: bool, progress: Progress) -> dict:
    """One switch: ``kind`` as version 1 and again as version 2, at ``factor`` x capacity."""
    workdir: Path = plan.workdir
    model = Path(ensure_model(workdir / "models", kind)["path"])
    factor = plan.simulated_factor if simulated else plan.real_factor
    config = config_toml(
        plan.simulated_batch if simulated else plan.max_batch_size,
        plan.batch_timeout_ms,
        simulate_device_ms=plan.simulate_device_ms if simulated else None,
        cpus_per_shard=plan.simulated_cpus_per_shard if simulated else None,
    )
    repo = Repository.fresh(workdir / "repos" / label, config)
    repo.add_version(1, model)
    bodies = v2_bodies(plan.bodies, plan.seed)
    progress(f"[rollout {label}] {kind} model, version 1 served; measuring capacity")
    with server(repo, workdir, label) as proc:
        measured = capacity(proc, bodies, plan.capacity_clients, plan.capacity_s)
        wait_idle(base(proc), 60.0, 0.2)
        rate = factor * measured
        if not simulated and plan.real_rate is not None:
            rate = plan.real_rate
            factor = rate / measured
        progress(
            f"  capacity {measured:.1f} req/s; {factor:.2g}x = {rate:.1f} req/s for "
            f"at most {plan.switch_s:g} s ({plan.after_s:g} s past version 1 unloaded), version 2 "
            f"appears at {plan.appear_at_s:g} s"
        )
        start = time.perf_counter() + 0.5
        appear = Action(plan.appear_at_s, "appear", lambda: repo.add_version(2, model))
        with Sampler(base(proc), start, probes={"index": index(proc)}) as sampler:
            done = StopAfter(sampler, start, plan.after_s, plan.appear_at_s, _switched)
            timed = timeline.run(
                infer_url(proc),
                bodies,
                [Step(rate, plan.switch_s)],
                start=start,
                timeout_s=plan.request_timeout_s,
                actions=[appear],
                until=done,
            )
            _wait_for(sampler, lambda s: not serves(s, "1"), plan.unload_timeout_s)
    last_due = timed.replies[-1].due_s if timed.replies else plan.switch_s
    result = summarize_switch(timed.replies, timed.actions.get("appear"), sampler.samples, last_due)
    progress(
        f"  failed {result['failed']}, v1 answers after the switch {result['v1_after_switch']}, "
        f"to first v2 answer {result['to_first_v2_s']} s, to v1 unloaded "
        f"{result['to_v1_unloaded_s']} s; p99 steady {result['steady']['latency_ms'].get('p99')} "
        f"during {result['during']['latency_ms'].get('p99')} ms"
    )
    return {
        "label": label,
        "kind": kind,
        "simulated": simulated,
        "capacity_rps": measured,
        "factor": factor,
        "rate": rate,
        **result,
    }


def _switched(sample: Sample) -> bool:
    return serves(sample, "2") and not serves(sample, "1")


class StopAfter:
    """The load's stop: ``after_s`` past the first sample (after ``from_s``) where ``reached``
    holds; the sampler's thread takes the samples, this only reads the newest."""

    def __init__(
        self, sampler: Sampler, start: float, after_s: float, from_s: float, reached: Any
    ) -> None:
        self.sampler, self.start, self.after_s, self.from_s = sampler, start, after_s, from_s
        self.reached = reached
        self.at: float | None = None

    def __call__(self) -> bool:
        if self.at is None:
            last = self.sampler.samples[-1] if self.sampler.samples else None
            if last is not None and last.t_s > self.from_s and self.reached(last):
                self.at = last.t_s
            return False
        return time.perf_counter() - self.start > self.at + self.after_s


def _wait_for(sampler: Sampler, holds: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = sampler.sample_now()
        if sample is not None and holds(sample):
            return
        time.sleep(sampler.interval_s)  # another process's state: no event to wait on


def summarize_switch(
    replies: list[Reply], appear_s: float | None, samples: list[Sample], seconds: float
) -> dict[str, Any]:
    """What the clients and ``/metrics`` saw of one switch (times from the load's start)."""
    end = max([seconds, *(r.due_s for r in replies)])
    first_v2 = first_answer_s(replies, "2")
    unloaded = (
        first_at(samples, lambda s: serves(s, "2") and not serves(s, "1"), appear_s)
        if appear_s is not None
        else None
    )
    switch_end = unloaded if unloaded is not None else end
    failed = [r for r in replies if not r.ok]
    return {
        "requests": len(replies),
        "failed": len(failed),
        "appear_s": appear_s,
        "first_v2_answer_s": first_v2,
        "v1_unloaded_s": unloaded,
        "to_first_v2_s": _since(first_v2, appear_s),
        "to_v1_unloaded_s": _since(unloaded, appear_s),
        "v1_after_switch": answers_after(replies, "1", first_v2) if first_v2 is not None else None,
        "steady": summarize(replies, 0.0, appear_s if appear_s is not None else end),
        "during": summarize(replies, appear_s, switch_end) if appear_s is not None else None,
        "after": summarize(replies, switch_end, end + 1e-9),
        "p99_ratio": p99_ratio(replies, appear_s, switch_end),
        "by_version": by_version(replies),
        "failures": failures(replies),
    }


def p99_ratio(replies: list[Reply], appear_s: float | None, switch_end: float) -> float | None:
    """p99 of the answered requests during the switch over p99 before it."""
    if appear_s is None:
        return None
    steady = summarize(replies, 0.0, appear_s)["latency_ms"].get("p99")
    during = summarize(replies, appear_s, switch_end)["latency_ms"].get("p99")
    return round(during / steady, 3) if steady and during else None


def _since(t: float | None, origin: float | None) -> float | None:
    return None if t is None or origin is None else round(t - origin, 3)
