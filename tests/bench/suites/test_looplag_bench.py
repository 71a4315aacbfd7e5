"""`python -m bench looplag` on a tiny setting, so that it cannot rot: demo-tiny, small bodies,
one round of 1 s phases. The server joins the session's Ray instead of starting a second one."""

from __future__ import annotations

import orjson

from bench.suites.looplag import big_body, summarize
from tests.bench.suiterun import SuiteRun


def test_big_body_fills_the_size_without_going_over() -> None:
    body, rows = big_body(8, 100_000)
    assert 90_000 < len(body) <= 100_000
    assert len(orjson.loads(body)["instances"]) == rows


def test_summary_pairs_each_round_of_new_with_old() -> None:
    def turn(tree: str, round_: int, p99: float) -> dict[str, object]:
        phase = {"p50_ms": 1.0, "p99_ms": p99}
        return {"tree": tree, "round": round_, "alone": phase, "loaded": phase}

    turns = [turn("new", 0, 10.0), turn("old", 0, 20.0), turn("old", 1, 40.0), turn("new", 1, 8)]
    summary = summarize(turns)
    assert summary["ratio_per_round"] == [0.5, 0.2]
    assert summary["ratio"] == 9.0 / 30.0


def test_looplag_reports_both_phases(bench_on_session_ray: SuiteRun) -> None:
    args = ["--model", "demo-tiny", "--big-bytes", "30000", "--seconds", "1"]
    args += ["--rounds", "1", "--ramp", "0.3", "--probe-every-ms", "50", "--no-pin"]
    results = bench_on_session_ray.run("looplag", *args)
    (turn,) = results["turns"]
    assert turn["tree"] == "new"
    for phase in ("alone", "loaded"):
        assert turn[phase]["requests"] > 0
        assert turn[phase]["errors"] == 0
        assert 0 < turn[phase]["p50_ms"] <= turn[phase]["p99_ms"]
    assert turn["big"]["requests"] > 0 and turn["big"]["errors"] == 0
    table = bench_on_session_ray.table("looplag")
    assert "| 0 | new |" in table
    assert "loaded p99" in table
