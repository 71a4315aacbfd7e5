"""The observers: a process's CPU seconds from /proc, other benches seen running, a scrape."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.observe.cpusplit import _part, per_work, process_cpu_seconds
from bench.observe.quiet import other_benches
from bench.observe.scrape import parse


def test_cpu_seconds_of_this_process_grow_with_its_work() -> None:
    # Spin on Python's own CPU clock, not on the function under test: a reading that never
    # grows then fails the comparison below instead of spinning for ever.
    before, own_before = process_cpu_seconds(os.getpid()), time.process_time()
    deadline = time.monotonic() + 30
    while time.process_time() - own_before < 0.2:
        assert time.monotonic() < deadline, "0.2 s of CPU took over 30 s of wall time"
        sum(range(10_000))
    grew = process_cpu_seconds(os.getpid()) - before
    spent = time.process_time() - own_before
    # /proc counts in clock ticks (10 ms); other threads of pytest run between the readings.
    assert grew == pytest.approx(spent, abs=0.05)


def test_other_benches_lists_a_running_bench_process_until_it_ends() -> None:
    # argv after -c's code is the script's own: the process looks like "python ... -m bench".
    code = "import sys, time; time.sleep(60)"
    fake = subprocess.Popen([sys.executable, "-c", code, "-m", "bench", "protocols", "marker"])
    try:
        deadline = time.monotonic() + 10
        while not any(line.endswith("protocols marker") for line in other_benches()):
            assert time.monotonic() < deadline, other_benches()
            time.sleep(0.05)
    finally:
        fake.kill()
        fake.wait()
    assert not any(line.endswith("protocols marker") for line in other_benches())


def test_a_scrape_sums_the_served_versions_under_the_series_plain_names() -> None:
    text = "\n".join(
        [
            "# TYPE shardserve_batch_size_rows histogram",
            'shardserve_batch_size_rows_count{model="a",version="1"} 3.0',
            'shardserve_batch_size_rows_count{model="a",version="2"} 4.0',
            'shardserve_stage_calls_total{model="a",replica="0",stage="1",version="1"} 5.0',
            'shardserve_padded_positions_total{kind="pad",model="a",version="1"} 2.0',
        ]
    )

    assert parse(text) == {
        "shardserve_batch_size_rows_count": 7.0,
        'shardserve_stage_calls_total{replica="0",stage="1"}': 5.0,
        'shardserve_padded_positions_total{kind="pad"}': 2.0,
    }


def test_cpu_per_unit_of_work_and_the_idle_share() -> None:
    # 10 s on 2 cores: the front end used 0.5 cores, the actor 1.0, the rest of Ray 0.1.
    parts = {"frontend": 0.5, "shard_actors": 1.0, "ray_other": 0.1, "load_generator": 0.2}
    work = per_work(parts, 10.0, served=1000, rows=4000, machine_cores=2)
    assert work["frontend_ms_per_request"] == pytest.approx(5.0)
    assert work["workers_ms_per_row"] == pytest.approx(2.5)
    assert work["ray_ms_per_request"] == pytest.approx(1.0)
    assert work["idle_share"] == pytest.approx(0.1)
    # A server that counts no rows (a peer): its workers per request.
    assert per_work(parts, 10.0, 1000, None, 2)["workers_ms_per_row"] == pytest.approx(10.0)


def test_a_servers_children_count_as_its_model_workers_or_the_rest_of_ray() -> None:
    assert _part(["ray::ShardActor.run"]) == "shard_actors"
    assert _part(["ray::ServeReplica:app:Model"]) == "shard_actors"
    assert _part(["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet"]) == (
        "ray_other"
    )
    assert _part(["ray::IDLE"]) == "ray_other"
    assert _part(["python", "-c", "from multiprocessing.spawn import spawn_main"]) == (
        "shard_actors"
    )  # a LitServe worker
