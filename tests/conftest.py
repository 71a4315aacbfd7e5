"""Markers by directory and the one local Ray instance of a test session.

tests/serving  -> no marker (pure Python, fake model runner, no Ray, no TensorFlow)
tests/shards   -> ray
tests/e2e      -> ray, slow
tests/loadtest -> none (test_tune_sweep.py: ray, slow, by its own pytestmark)
tests/bench    -> ray, slow (the benchmark harness on a tiny setting)
tests/gpu      -> gpu (skipped with a reason when no GPU is visible)

A test's markers follow the first folder under tests/: tests/shards/pipeline/ is tests/shards.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

# Ray 2.60 turns on token authentication; a second driver (the server subprocess of the e2e
# tests) could not attach to the session's Ray without the token.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# gRPC is opt-in in tests: the servers they start (in process or as subprocesses) bind no gRPC
# port unless a test gives one, so test runs side by side never contend for the default 8001.
os.environ.setdefault("SHARDSERVE_GRPC_PORT", "0")
# The collector's freeze at READY (a full collection, 0.2-0.8 s) is off for the apps the tests
# start in this process, ~150 of them; tests/serving/version/test_collector.py turns it on, and the
# servers started as subprocesses keep the default (tests/serverproc.ray_env drops this).
os.environ.setdefault("SHARDSERVE_GC_FREEZE", "false")

_MARKS_BY_DIR = {
    "shards": ("ray",),
    "e2e": ("ray", "slow"),
    "loadtest": (),  # pure; the sweep module marks itself ray + slow
    "bench": ("ray", "slow"),
    "deploy": (),
    "gpu": ("gpu",),
}


def _gpu_visible() -> bool:
    return shutil.which("nvidia-smi") is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_root = Path(__file__).parent
    skip_gpu = pytest.mark.skip(reason="no GPU visible on this machine (nvidia-smi not found)")
    for item in items:
        rel = Path(str(item.fspath)).relative_to(tests_root)
        for name in _MARKS_BY_DIR.get(rel.parts[0], ()):
            item.add_marker(getattr(pytest.mark, name))
        if "gpu" in item.keywords and not _gpu_visible():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """Start ONE private local Ray for the whole session; yield its GCS address.

    Declares 4 logical CPUs on the 2-core machine so that two 2-stage pipelines (or one pipeline
    and a partition task) fit at once; each shard actor still runs one intra-op thread.
    """
    import ray

    ctx = ray.init(
        address="local",
        num_cpus=4,
        num_gpus=0,
        include_dashboard=False,
        logging_level="warning",
        configure_logging=True,
    )
    try:
        yield str(ctx.address_info["gcs_address"])
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One bundle cache for the servers of the built-in demo models that do not look into their
    cache: each demo model and stage count is partitioned once per session (~4.5 s a server)."""
    return tmp_path_factory.mktemp("demo-cache")


@pytest.fixture(autouse=True)
def _fresh_failure_lines() -> None:
    """Each test starts a new interval of failure log lines (``serving.http.replies``): the
    400s of the tests before would otherwise leave its own lines summarised."""
    from serving.http.replies import failure_lines

    failure_lines.reset()
