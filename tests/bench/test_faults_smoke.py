"""The issue-10 benches (``python -m bench overload`` and ``chaos``) on a tiny setting, so that
they cannot rot, and their parsing and judging on canned inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest

from bench.__main__ import main
from bench.load.chaos import judge
from bench.load.hey import HEY_INSTALL_HINT, have_hey, parse_csv, summarize
from bench.models.tokens import POISON_ID
from bench.suites.chaos import ChaosPlan, make_rows, with_options
from bench.suites.overload import per_client_rate
from tests.serverproc import free_ports

HEY_CSV = """response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset
0.0100,0.0001,0.0000,0.0000,0.0099,0.0000,200,0.5000
0.3000,0.0001,0.0000,0.0000,0.2999,0.0000,200,1.0000
0.0020,0.0001,0.0000,0.0000,0.0019,0.0000,503,1.2000
0.0040,0.0001,0.0000,0.0000,0.0039,0.0000,503,2.4960
"""


def test_hey_csv_is_split_by_status() -> None:
    result = parse_csv(HEY_CSV, clients=4, rate_per_client=2.0)
    assert result.count(200) == 2 and result.count(503) == 2
    assert result.seconds == pytest.approx(2.0)  # first start 0.5 s, last answer at 2.5 s
    assert result.per_s(200) == pytest.approx(1.0)
    assert result.per_s() == pytest.approx(2.0)
    assert result.statuses[200].max_ms == pytest.approx(300.0)
    assert result.p99_ms(503) == pytest.approx(3.98)
    assert result.p99_ms(500) is None


def test_burst_share_tells_clients_in_step_from_clients_spread_out() -> None:
    in_step = [(503, 0.001, 0.0, tick + 0.01) for tick in range(10) for _ in range(50)]
    spread = [(503, 0.001, 0.0, i / 50 + 0.001) for i in range(500)]
    assert summarize(in_step, clients=50, rate_per_client=1.0).burst_share == 1.0
    assert summarize(spread, clients=50, rate_per_client=1.0).burst_share == pytest.approx(0.1)
    assert summarize(spread, clients=50, rate_per_client=None).burst_share is None


def test_each_client_gets_its_share_of_the_offered_rate_rounded_up() -> None:
    assert per_client_rate(1000.0, 3.0, 1500) == 2.0
    assert per_client_rate(1001.0, 3.0, 1500) == 2.01
    assert per_client_rate(1.0, 3.0, 1500) == 0.01


def test_answers_are_judged_against_the_model() -> None:
    want = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    ok = orjson.dumps({"predictions": [[0.5, -1.0, 2.0]]})
    off = orjson.dumps({"predictions": [[0.5, -1.0, 2.1]]})
    poison = b'{"error": "the model failed on this input: InvalidArgumentError: ..."}'
    assert judge(200, ok, False, want) == ("ok", "")
    assert judge(200, off, False, want)[0] == "wrong"
    assert judge(422, poison, False, want)[0] == "wrong"  # an innocent request blamed
    assert judge(503, b"{}", False, want)[0] == "lost"
    assert judge(0, b"", False, want) == ("lost", "no answer")
    assert judge(422, poison, True, want) == ("poison_422", "")
    assert judge(500, b"{}", True, want)[0] == "poison_wrong"


def test_one_percent_of_the_rows_hold_exactly_one_poisoned_id() -> None:
    rows, poisoned = make_rows(ChaosPlan(seconds=10, rate=100, poison_fraction=0.01))
    assert rows.shape == (1000, 4) and poisoned.sum() == 10
    assert ((rows == POISON_ID).sum(axis=1) == poisoned).all()
    assert ((rows[~poisoned] >= 0) & (rows[~poisoned] < 10)).all()


def test_server_options_are_replaced_or_added() -> None:
    argv = ["shardserve", "serve", "--cpus-per-shard", "2", "--port", "1"]
    out = with_options(argv, {"--cpus-per-shard": "1", "--replicas": "2"})
    assert out == ["shardserve", "serve", "--cpus-per-shard", "1", "--port", "1", "--replicas", "2"]


@pytest.mark.skipif(not have_hey(), reason=f"hey is not installed; {HEY_INSTALL_HINT}")
def test_overload_bench_runs_on_a_tiny_setting(
    ray_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHARDSERVE_RAY_ADDRESS", ray_address)
    out = tmp_path / "out"
    (port,) = free_ports(1)
    argv = ["overload", "--workload", "light", "--max-batch-size", "8", "--warmup", "1"]
    argv += ["--capacity-clients", "8", "--capacity-seconds", "2", "--clients", "64"]
    argv += ["--seconds", "2", "--staggered-groups", "4", "--retry-seconds", "2"]
    argv += ["--port", str(port)]
    argv += ["--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert main(argv) == 0

    results = orjson.loads((out / "overload.json").read_bytes())
    phases = {p["phase"]: p for p in results["phases"]}
    assert list(phases) == ["capacity", "overload", "overload, 4 staggered hey", "retry storm"]
    assert results["capacity"] > 0
    assert phases["capacity"]["goodput_ratio"] == pytest.approx(1.0)
    assert phases["overload"]["rate_per_client"] > 0
    for phase in phases.values():
        assert phase["good_per_s"] > 0
        assert phase["rss_after_mb"] > 0
        assert set(phase["statuses"]) <= {"200", "503"}
    assert "| target (overload phase) |" in (out / "overload.md").read_text()


def test_chaos_bench_runs_on_a_tiny_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own private Ray: the shard actors it kills are found among the server's descendants.
    monkeypatch.delenv("SHARDSERVE_RAY_ADDRESS", raising=False)
    out = tmp_path / "out"
    (port,) = free_ports(1)
    argv = ["chaos", "--seconds", "5", "--rate", "20", "--kill-every", "3"]
    argv += ["--poison-fraction", "0.1", "--port", str(port)]
    argv += ["--workdir", str(tmp_path / "work"), "--out", str(out)]
    assert main(argv) == 0

    results = orjson.loads((out / "chaos.json").read_bytes())
    verdicts = results["verdicts"]
    assert results["requests"] == 100 and results["poisoned"] == 10
    assert sum(verdicts.values()) == 100
    assert verdicts["poison_422"] == 10
    assert verdicts["ok"] > 0 and verdicts["wrong"] == 0
    assert len(results["kills"]) == 1 and results["kills"][0]["pid"] is not None
    assert results["healthy_replicas_at_end"] == 2
    assert "| requests | poisoned |" in (out / "chaos.md").read_text()
