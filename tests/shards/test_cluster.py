"""The Ray connection helpers (``shards.cluster``): reuse, summary, the local modules uploaded to
a cluster, calls bounded in time, what each stage asks for."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shards.cluster import (
    cluster_summary,
    connect,
    cpus_per_stage,
    intra_op_threads,
    local_py_modules,
    run_bounded,
)


def test_connect_reuses_the_ray_of_this_process(ray_address: str) -> None:
    assert connect(None, num_cpus=1) == ray_address


def test_cluster_summary_counts_the_session_cluster(ray_address: str) -> None:
    summary = cluster_summary()

    assert (summary["nodes"], summary["cpus"], summary["gpus"]) == (1, 4.0, 0.0)


def test_local_py_modules_lists_module_files_not_installed_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_layers.py").write_text("X = 1\n")
    (tmp_path / "my_pkg").mkdir()
    (tmp_path / "my_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_pkg" / "blocks.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    found = local_py_modules(["my_layers", "my_pkg.blocks", "numpy", "json", "not_a_module_x"])

    assert found == [str(tmp_path / "my_layers.py"), str(tmp_path / "my_pkg")]


def test_run_bounded_returns_false_for_a_call_that_does_not_finish() -> None:
    unblock = threading.Event()
    try:
        assert run_bounded(unblock.wait, 0.05, "a blocked call") is False
    finally:
        unblock.set()


def test_run_bounded_logs_an_error_instead_of_raising(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise ConnectionError("GCS unreachable at 10.0.0.1:6379")

    assert run_bounded(broken, 5.0, "removing a placement group") is True
    assert "removing a placement group failed" in caplog.text
    assert "GCS unreachable at 10.0.0.1:6379" in caplog.text


@pytest.mark.parametrize(
    ("requested", "private", "actors", "cpus", "expected"),
    [
        (None, True, 4, 2.0, 0.5),  # 4 stages on 2 cores: half a core each
        (None, True, 3, 2.0, 0.6666),  # rounded down to Ray's 1e-4 unit so all three fit
        (None, True, 2, 8.0, 4.0),  # spare cores become threads
        (None, False, 4, 2.0, 1.0),  # a cluster's CPUs are real: one each
        (2.0, True, 4, 2.0, 2.0),  # what the user asked for is kept
    ],
)
def test_cpus_per_stage_splits_a_private_rays_cores(
    requested: float | None, private: bool, actors: int, cpus: float, expected: float
) -> None:
    share = cpus_per_stage(requested, private_ray=private, actors=actors, cluster_cpus=cpus)
    assert share == expected
    if requested is None and private:
        assert share * actors <= cpus


@pytest.mark.parametrize(("cpus", "threads"), [(0.25, 1), (0.5, 1), (1.0, 1), (1.5, 1), (4.0, 4)])
def test_intra_op_threads_are_whole_cores_at_least_one(cpus: float, threads: int) -> None:
    assert intra_op_threads(cpus) == threads
