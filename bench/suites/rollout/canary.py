"""The rollout bench's canaries: version 2 arrives as a canary at the configured weights under
an open-loop load on version 1, and must be rolled back on its own.

- **broken**: a version that raises on most inputs (``bench.models.versions`` "broken": 422s,
  the model raised): rolled back on errors within its window, the failed requests at most the
  canary's share of the requests of that window.
- **slow**: a version with much more compute per row ("slow"): rolled back on latency.

Measured (``summarize_canary``, pure): when the canary took traffic (the admin rollout view, or
its first answer), when the rollback showed in ``shardserve_rollbacks_total``, the reason label
it was counted under, the failed requests against the allowed share, answers from the canary to
requests sent after the rollback, and each version's latency while both served.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.load import timeline
from bench.load.replies import answers_after, by_version, failures, first_answer_s, within
from bench.load.timeline import Action, Reply, Step
from bench.models.versions import ensure_model, v2_bodies
from bench.observe.sampler import Sample, Sampler, first_at, labels_of
from bench.options import Progress
from bench.suites.rollout.server import (
    Repository,
    base,
    config_toml,
    index,
    infer_url,
    rollout_view,
    server,
)
from bench.suites.rollout.switch import StopAfter

ROLLBACKS = "shardserve_rollbacks_total"


def canary_rules(plan: Any) -> dict[str, Any]:
    return {
        "window_s": plan.window_s,
        "min_requests": plan.min_requests,
        "error_margin": 0.02,
        "latency_factor": 2.0,
        "promote": "manual",
    }


def run_canary(plan: Any, kind: str, progress: Progress) -> dict[str, Any]:
    """Light version 1 as the stable, ``kind`` (broken or slow) as the canary."""
    workdir: Path = plan.workdir
    stable = ensure_model(workdir / "models", "light")
    canary = ensure_model(workdir / "models", kind, plan.slow_layers)
    weights = (100 - plan.canary_percent, plan.canary_percent)
    config = config_toml(
        plan.max_batch_size, plan.batch_timeout_ms, canary=canary_rules(plan), weights=weights
    )
    label = f"canary-{kind}"
    repo = Repository.fresh(workdir / "repos" / label, config)
    repo.add_version(1, Path(stable["path"]))
    progress(
        f"[rollout {label}] {kind} canary at {plan.canary_percent}% (one row: {canary['row_ms']:.1f}"
        f" ms, the stable's {stable['row_ms']:.1f} ms), {plan.canary_rate:g} req/s for "
        f"at most {plan.canary_s:g} s, window {plan.window_s:g} s, min {plan.min_requests} requests"
    )
    with server(repo, workdir, label) as proc:
        start = time.perf_counter() + 0.5
        appear = Action(
            plan.canary_at_s, "appear", lambda: repo.add_version(2, Path(canary["path"]))
        )
        probes = {"rollout": rollout_view(proc), "index": index(proc)}
        with Sampler(base(proc), start, probes=probes) as sampler:
            done = StopAfter(sampler, start, plan.after_s, plan.canary_at_s, rolled_back)
            timed = timeline.run(
                infer_url(proc),
                v2_bodies(plan.bodies, plan.seed),
                [Step(plan.canary_rate, plan.canary_s)],
                start=start,
                timeout_s=plan.request_timeout_s,
                actions=[appear],
                until=done,
            )
        final, final_index = rollout_view(proc)(), index(proc)()
    result = summarize_canary(
        timed.replies, timed.actions.get("appear"), sampler.samples, plan.window_s, weights
    )
    result.update(kind=kind, rate=plan.canary_rate, row_ms={"stable": stable["row_ms"]})
    result["row_ms"]["canary"] = canary["row_ms"]
    result["final_view"], result["final_index"] = final, final_index
    progress(
        f"  rolled back after {result['to_rollback_s']} s ({result['reason']}); failed "
        f"{result['failed']} of at most {result['allowed_failures']}; canary answers after "
        f"the rollback {result['canary_after_rollback']}"
    )
    return result


def canary_taking_traffic(sample: Sample) -> bool:
    view = sample.extra.get("rollout")
    if not isinstance(view, dict):
        return False
    weights = view.get("weights") or {}
    return str(view.get("canary")) == "2" and bool(weights.get("canary", 1))


def rolled_back(sample: Sample) -> bool:
    return rollback_reasons(sample) != []


def rollback_reasons(sample: Sample) -> list[str]:
    """The reasons version 2 was rolled back under (their counters above 0)."""
    out = []
    for key, value in sample.series.items():
        name, labels = labels_of(key)
        if name == ROLLBACKS and labels.get("version") == "2" and value > 0:
            out.append(labels.get("reason", ""))
    return sorted(out)


def summarize_canary(
    replies: list[Reply],
    appear_s: float | None,
    samples: list[Sample],
    window_s: float,
    weights: tuple[int, int],
) -> dict[str, Any]:
    """What the clients and ``/metrics`` saw of one canary (times from the load's start)."""
    after = appear_s if appear_s is not None else 0.0
    # The canary's first outcome: the admin view saying so, else its first answer or failure.
    seen = [first_at(samples, canary_taking_traffic, after), first_answer_s(replies, "2")]
    first_fail = next((r.done_s for r in replies if not r.ok and r.due_s >= after), None)
    since = min([t for t in (*seen, first_fail) if t is not None], default=None)
    back = first_at(samples, rolled_back, after)
    reasons = next((rollback_reasons(s) for s in samples if rolled_back(s)), [])
    share = weights[1] / sum(weights)
    in_window = within(replies, since, since + window_s) if since is not None else []
    failed = [r for r in replies if not r.ok]
    to_rollback = None if back is None or since is None else round(back - since, 3)
    both = within(replies, since, back) if since is not None and back is not None else []
    return {
        "requests": len(replies),
        "failed": len(failed),
        "statuses": _statuses(replies),
        "appear_s": appear_s,
        "canary_since_s": since,
        "rolled_back_s": back,
        "to_rollback_s": to_rollback,
        "within_window": to_rollback is not None and to_rollback <= window_s,
        "reason": ",".join(reasons) or None,
        "share": share,
        "window_requests": len(in_window),
        "allowed_failures": int(share * len(in_window)),
        "canary_answers": sum(1 for r in replies if r.ok and r.version == "2"),
        "canary_after_rollback": answers_after(replies, "2", back) if back is not None else None,
        "while_both": by_version(both),
        "failures": failures(replies),
    }


def _statuses(replies: list[Reply]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in replies:
        out[str(r.status)] = out.get(str(r.status), 0) + 1
    return dict(sorted(out.items()))
