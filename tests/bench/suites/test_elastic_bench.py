"""The elastic bench's pure parts: one replica's capacity, the stages, what each stage is read
as from replies and sampled gauges, and the table's verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from bench.load.timeline import Reply, Step, step_bounds
from bench.observe.sampler import Sample
from bench.suites.elastic.check import summarize_elastic
from bench.suites.elastic.report import render
from bench.suites.elastic.run import ElasticPlan, replica_capacity, stages


def test_one_replica_delivers_a_full_batch_every_simulated_run_and_the_stages_follow() -> None:
    plan = ElasticPlan(simulate_device_ms=50.0, max_batch_size=4)
    assert replica_capacity(plan) == 80.0
    named = stages(plan, 80.0)
    assert list(named) == ["low", "high", "quiet", "steady"]
    assert named["high"] == Step(200.0, 60.0) and named["steady"].rate == 120.0
    assert "steady" not in stages(ElasticPlan(steady_s=0.0), 80.0)
    with pytest.raises(ValueError, match=r"--max-replicas \(1\) must be >= --min-replicas \(2\)"):
        ElasticPlan(min_replicas=2, max_replicas=1)


def sample(t: float, healthy: int, starting: int = 0, up: int = 0, down: int = 0) -> Sample:
    key = 'shardserve_replicas{{model="tokens",version="1",state="{}"}}'
    event = 'shardserve_scale_events_total{{model="tokens",version="1",direction="{}",reason="q"}}'
    return Sample(
        t,
        {
            key.format("healthy"): float(healthy),
            key.format("starting"): float(starting),
            event.format("up"): float(up),
            event.format("down"): float(down),
        },
    )


def run() -> tuple[list[Reply], list[Sample], dict[str, tuple[float, float]]]:
    # low 0-10 s at 10/s, high 10-30 s at 50/s, quiet 30-40 s at 10/s, steady 40-60 s at 20/s
    steps = [Step(10, 10), Step(50, 20), Step(10, 10), Step(20, 20)]
    spans = dict(zip(["low", "high", "quiet", "steady"], step_bounds(steps), strict=True))
    replies: list[Reply] = []
    for lo, hi, rate in ((0, 10, 10), (10, 30, 50), (30, 40, 10), (40, 60, 20)):
        for k in range(int((hi - lo) * rate)):
            due = lo + k / rate
            slow, refused = 10 <= due < 16, 10 <= due < 13 and k % 5 == 0
            status = 503 if refused else 200
            replies.append(Reply(len(replies), due, 900.0 if slow else 60.0, status, "1"))
    samples = [sample(0, 1), sample(12, 1, 1, up=1), sample(15, 2, 1, up=2), sample(18, 3, up=2)]
    samples += [sample(31, 3, up=2), sample(33, 2, up=2, down=1), sample(36, 1, up=2, down=2)]
    samples += [sample(41, 1, up=2, down=2), sample(45, 1, 1, up=3, down=2)]
    samples.append(sample(48, 2, up=3, down=2))
    return replies, samples, spans


def results() -> dict[str, Any]:
    replies, samples, spans = run()
    rates = {"low": 10.0, "high": 50.0, "quiet": 10.0, "steady": 20.0}
    got = summarize_elastic(
        replies, samples, spans, rates, target_ms=200.0, window_s=2.0, minimum=1
    )
    plan = {**vars(ElasticPlan()), "workdir": "w"}
    capacity = {"computed_rps": 80.0, "measured_rps": 78.0, "unit_rps": 80.0}
    stages_ = {k: {"rate": rates[k], "span": spans[k]} for k in spans}
    return {"plan": plan, "capacity": capacity, "stages": stages_, **got}


def test_each_stage_is_read_from_the_replies_and_the_gauges() -> None:
    got = results()
    high = got["high"]
    assert high["to_p99_under_target_s"] == 6.0
    assert high["whole"]["statuses"]["503"] == 30
    assert high["once_scaled"]["failed"] == 0 and high["goodput_ratio"] == pytest.approx(1.0)
    assert high["max_healthy"] == 3
    assert got["quiet"]["to_min_replicas_s"] == 6.0 and got["quiet"]["scale_down_events"] == 2
    assert got["quiet"]["whole"]["failed"] == 0
    assert got["steady"]["scale_events"] == 1 and got["steady"]["healthy_changes"] == 1
    assert got["replicas_over_time"][:3] == [(0, 1.0), (15, 2.0), (18, 3.0)]


def test_the_table_says_which_targets_were_met() -> None:
    table = render(results())
    assert "| high, once scaled | 50.0 | 700 | 50.0 | 0 | 0.00% |" in table
    assert "p99 under target after 6.0 s; at most 3 healthy replicas" in table
    assert "Target (high: p99 back under 200 ms, then goodput >= 0.9x offered" in table
    assert table.count(": met") == 3 and "missed" not in table
    assert (
        "Healthy replicas over time: 0 s: 1, 15 s: 2, 18 s: 3, 33 s: 2, 36 s: 1, 48 s: 2." in table
    )
