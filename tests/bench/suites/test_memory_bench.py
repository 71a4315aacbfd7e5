"""`python -m bench memory` on a tiny model: the plan-vs-measured table per stage."""

from __future__ import annotations

from tests.bench.suiterun import SuiteRun


def test_memory_bench_measures_every_stage(bench: SuiteRun) -> None:
    # A child: the bench starts a local Ray of its own.
    results = bench.run("memory", "--models", "tiny", "--stages", "2", child=True, timeout_s=600)
    assert results["bare_tf_rss"] > 100 * 2**20
    stages = results["models"]["tiny"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    for stage in stages:
        assert stage["planned"] == stage["weights"] + stage["activations"] + stage["overhead"]
        assert stage["rss"] > stage["marks"]["tensorflow"] > stage["marks"]["start"]
    table = bench.table("memory")
    assert "| tiny (batch 8) | 1 | d1..d1 |" in table
