"""The Ray connection helpers (``shards.cluster``): reuse, summary, the local modules uploaded to
a cluster, calls bounded in time, a pipeline the cluster cannot hold refused with what it
needs and what is free."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from shards.cluster import (
    check_cluster_fits,
    cluster_summary,
    connect,
    local_py_modules,
    run_bounded,
)
from shards.errors import InsufficientResourcesError


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


def test_a_memory_plan_over_the_cluster_is_refused_naming_what_it_needs_and_what_is_free(
    ray_address: str,
) -> None:
    bundles = [{"CPU": 1.0, "memory": 3.0 * 2**50}, {"CPU": 1.0, "memory": 1.0 * 2**50}]

    with pytest.raises(InsufficientResourcesError) as refused:
        check_cluster_fits(bundles, 1, "PACK")

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "the pipeline needs memory=4096.0 TiB (1 replica(s) x 2 stage(s), per stage "
        "[{'CPU': '1', 'memory': '3072.0 TiB'}, {'CPU': '1', 'memory': '1024.0 TiB'}]) but "
        "the cluster has only memory="
    )
    assert " GiB free); the memory plan of its stages" in message
    assert "cut it into more stages" in message
