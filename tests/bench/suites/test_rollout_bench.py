"""The rollout bench's pure parts: its plan and --quick, the model's config.toml, what a switch
and a canary are read as from replies and sampled gauges, and the table's verdicts (the servers
it starts are for the bench runs themselves)."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from bench.load.timeline import Reply
from bench.observe.sampler import Sample
from bench.suites.rollout.canary import summarize_canary
from bench.suites.rollout.report import render
from bench.suites.rollout.run import QUICK, RolloutPlan, quick
from bench.suites.rollout.server import config_toml
from bench.suites.rollout.switch import summarize_switch


def ok(i: int, due: float, ms: float, version: str) -> Reply:
    return Reply(i, due, ms, 200, version)


def failed(i: int, due: float, status: int = 422) -> Reply:
    return Reply(i, due, 5.0, status, "", f"{status}: the model failed")


def replicas(t: float, *versions: str) -> Sample:
    key = 'shardserve_replicas{{model="tokens",version="{}",state="healthy"}}'
    return Sample(t, {key.format(v): 1.0 for v in versions})


def test_the_plan_refuses_unknown_parts_and_quick_shortens_only_the_defaults() -> None:
    with pytest.raises(ValueError, match="parts must be some of switch, simulated, canary"):
        RolloutPlan(parts=("switch", "rolling"))
    with pytest.raises(ValueError, match="--appear-at must fall inside the load"):
        RolloutPlan(switch_s=10.0, appear_at_s=12.0)
    with pytest.raises(ValueError, match="--real-rate must be > 0, got 0"):
        RolloutPlan(real_rate=0.0)
    short = quick(RolloutPlan(quick=True, canary_s=30.0), QUICK)
    assert short.switch_s == QUICK["switch_s"] and short.canary_s == 30.0


def test_the_config_toml_holds_the_simulated_device_and_the_canary_rules() -> None:
    text = config_toml(8, 5.0, simulate_device_ms=40.0, cpus_per_shard=0.25)
    assert tomllib.loads(text) == {
        "max_batch_size": 8,
        "batch_timeout_ms": 5,
        "simulate_device_ms": 40,
        "cpus_per_shard": 0.25,
        "versions": {"policy": "latest", "n": 1},
    }
    rules = {"window_s": 8.0, "min_requests": 10, "promote": "manual"}
    canary = tomllib.loads(config_toml(8, 5.0, canary=rules, weights=(90, 10)))
    assert canary["traffic"] == {"stable": 90, "canary": 10}
    assert canary["canary"] == rules


def switch_run() -> tuple[list[Reply], list[Sample]]:
    replies = [ok(i, i * 0.1, 10.0, "1") for i in range(50)]  # 0 .. 4.9 s
    replies += [ok(50, 5.0, 40.0, "1"), ok(51, 5.1, 30.0, "2")]  # v2's first answer at 5.13
    replies += [ok(52, 5.12, 20.0, "1"), ok(53, 5.2, 10.0, "1")]  # the last: after the switch
    replies += [ok(54 + i, 5.3 + i * 0.1, 10.0, "2") for i in range(20)]
    samples = [replicas(t, "1") for t in (0.0, 2.0, 3.0)] + [replicas(4.0, "1", "2")]
    samples += [replicas(6.0, "1", "2"), replicas(6.5, "2"), replicas(7.0, "2")]
    return replies, samples


def test_a_switch_is_timed_from_the_rename_and_a_late_v1_answer_is_counted() -> None:
    replies, samples = switch_run()
    got = summarize_switch(replies, 3.0, samples, 7.3)
    assert got["failed"] == 0 and got["requests"] == 74
    assert got["to_first_v2_s"] == pytest.approx(2.13)
    assert got["to_v1_unloaded_s"] == pytest.approx(3.5)
    assert got["v1_after_switch"] == 1
    assert got["steady"]["requests"] == 30 and got["during"]["to_s"] == 6.5
    assert got["p99_ratio"] is not None and got["p99_ratio"] > 1


def canary_run() -> tuple[list[Reply], list[Sample]]:
    replies = []
    for i in range(100):  # 10 req/s for 10 s; every 10th from 2 s to 5 s fails (the canary)
        due = i * 0.1
        replies.append(failed(i, due) if 20 <= i < 50 and i % 10 == 5 else ok(i, due, 8.0, "1"))
    view = {"stable": "1", "canary": "2", "weights": {"stable": 90, "canary": 10}}
    samples = [Sample(t, {}, {"rollout": None}) for t in (0.0, 1.0)]
    samples += [Sample(t, {}, {"rollout": view}) for t in (2.0, 3.0, 4.0)]
    back = {'shardserve_rollbacks_total{model="tokens",version="2",reason="errors"}': 1.0}
    samples += [Sample(t, back, {"rollout": {**view, "state": "rolled_back"}}) for t in (5.0, 6.0)]
    return replies, samples


def test_a_broken_canary_is_read_from_its_view_and_the_rollback_counter() -> None:
    replies, samples = canary_run()
    got = summarize_canary(replies, 1.5, samples, 4.0, (90, 10))
    assert got["canary_since_s"] == 2.0 and got["rolled_back_s"] == 5.0
    assert got["to_rollback_s"] == 3.0 and got["within_window"]
    assert got["reason"] == "errors" and got["failed"] == 3
    assert got["window_requests"] == 40 and got["allowed_failures"] == 4
    assert got["canary_after_rollback"] == 0


def results() -> dict[str, Any]:
    replies, samples = switch_run()
    real = summarize_switch(replies, 3.0, samples, 7.3)
    switch = {"kind": "light", "simulated": False, "capacity_rps": 200.0, "factor": 0.5}
    sim = {**switch, "simulated": True, "factor": 0.9}
    creplies, csamples = canary_run()
    canary = summarize_canary(creplies, 1.5, csamples, 4.0, (90, 10))
    canary.update(kind="broken", rate=10.0, row_ms={"stable": 2.0, "canary": 2.1})
    plan = RolloutPlan()
    return {
        "plan": {**vars(plan), "workdir": "w"},
        "switch": [{**switch, "rate": 100.0, **real}, {**sim, "rate": 180.0, **real}],
        "canary": [canary],
    }


def test_the_table_says_which_targets_were_met() -> None:
    table = render(results())
    assert "| light | 200.0 | 100.0 (0.5x) | 74 | 0 | 1 |" in table
    assert "light, simulated device" in table
    assert (
        "Target (switch: 0 failed requests, no answer from version 1 after the switch): "
        "**missed**." in table
    )
    assert (
        "| broken | 2.1 / 2.0 | 10 | 3.00 | yes (15 s) | errors | 3 | 4 (10% of 40) | 0 |" in table
    )
    assert (
        "Target (broken canary rolled back on errors within its window, failed <= its share): met."
        in table
    )
