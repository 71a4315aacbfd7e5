"""``python -m bench generate --priorities``: its command line, its table (the goal met or not),
and one short run on the session's Ray (nothing here is timed: the figures are only reported)."""

from __future__ import annotations

import argparse
from typing import Any

from bench.options import plan_from
from bench.suites import generate
from bench.suites.generate.priorities import FIGURES, render_priorities
from bench.suites.generate.run import GeneratePlan
from tests.bench.suiterun import SuiteRun


def _results(high_p95: float) -> dict[str, Any]:
    medians = dict.fromkeys(FIGURES, 0.0) | {
        "idle_ttft_p50_s": 0.010,
        "idle_ttft_p95_s": 0.012,
        "decode_step_s": 0.004,
        "goal_s": 0.020,
        "high_ttft_p50_s": 0.015,
        "high_ttft_p95_s": high_p95,
        "low_tokens_per_s_alone": 200.0,
        "low_tokens_per_s_with_high": 190.0,
        "low_tokens_lost": 0.05,
        "preemptions": 20.0,
    }
    plan = {"stages": 2, "batch": 4}
    return {"model": "tiny", "plan": plan, "rounds": [{}, {}, {}], "medians": medians}


def test_the_command_line_turns_the_priorities_run_on() -> None:
    parser = argparse.ArgumentParser()
    generate.add_parsers(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", "--priorities", "--probes", "5", "--low-clients", "3"])
    plan = plan_from(GeneratePlan, args)
    assert (plan.priorities, plan.probes, plan.low_clients) == (True, 5, 3)
    assert not plan_from(GeneratePlan, parser.parse_args(["generate"])).priorities


def test_the_table_says_whether_the_goal_was_met() -> None:
    met = render_priorities(_results(0.018))
    assert "| goal: idle TTFT p95 + 2 steps (ms) | 20.0 |" in met
    assert "15.0 / 18.0 (met)" in met and "| low tokens/s lost | 5.0% |" in met
    assert "medians of 3 round(s)" in met
    assert "(not met)" in render_priorities(_results(0.030))


def test_a_short_priorities_run_preempts_and_fails_no_low_request(
    bench_on_session_ray: SuiteRun,
) -> None:
    args = ["--priorities", "--blocks", "2", "--hidden", "32", "--stages", "1", "--batch", "2"]
    # 1 s per phase: the low clients' child process is sending by the end of the 1 s warm-up.
    args += ["--duration", "1", "--rounds", "1", "--warmup", "1", "--probes", "4"]
    args += ["--max-prompt", "24", "--min-tokens", "16", "--max-tokens", "32"]
    results = bench_on_session_ray.run("generate", *args)
    assert results["bench"] == "generate-priorities" and len(results["rounds"]) == 1
    record = results["rounds"][0]
    assert record["low_errors"] == 0
    assert record["high_ttft_p95_s"] > 0 and record["low_tokens_per_s_alone"] > 0
    assert "high TTFT p50 / p95" in bench_on_session_ray.table("generate")
