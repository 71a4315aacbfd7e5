"""``python -m bench chaos`` on a tiny setting, so that it cannot rot, and its poisoned rows."""

from __future__ import annotations

import pytest

from bench.models.tokens import POISON_ID
from bench.suites.chaos import ChaosPlan, make_rows
from tests.bench.suiterun import SuiteRun
from tests.serverproc import free_ports


def test_one_percent_of_the_rows_hold_exactly_one_poisoned_id() -> None:
    rows, poisoned = make_rows(ChaosPlan(seconds=10, rate=100, poison_fraction=0.01))
    assert rows.shape == (1000, 4) and poisoned.sum() == 10
    assert ((rows == POISON_ID).sum(axis=1) == poisoned).all()
    assert ((rows[~poisoned] >= 0) & (rows[~poisoned] < 10)).all()


def test_chaos_bench_runs_on_a_tiny_setting(
    bench: SuiteRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own private Ray: the shard actors it kills are found among the server's descendants.
    monkeypatch.delenv("SHARDSERVE_RAY_ADDRESS", raising=False)
    (port,) = free_ports(1)
    # One kill, early: the run lasts until the killed replica is back, however short the load.
    args = ["--seconds", "2", "--rate", "50", "--kill-every", "1.2"]
    results = bench.run("chaos", *args, "--poison-fraction", "0.1", "--port", str(port))
    verdicts = results["verdicts"]
    assert results["requests"] == 100 and results["poisoned"] == 10
    assert sum(verdicts.values()) == 100
    assert verdicts["poison_422"] == 10
    assert verdicts["ok"] > 0 and verdicts["wrong"] == 0
    assert len(results["kills"]) == 1 and results["kills"][0]["pid"] is not None
    assert results["healthy_replicas_at_end"] == 2
    assert "| requests | poisoned |" in bench.table("chaos")
