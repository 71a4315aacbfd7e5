"""What the bench tests share: a suite run on a tiny setting (``tests.bench.suiterun``), alone
or joining the session's Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.suiterun import SuiteRun


@pytest.fixture
def bench(tmp_path: Path) -> SuiteRun:
    return SuiteRun(tmp_path)


@pytest.fixture
def bench_on_session_ray(
    bench: SuiteRun, ray_address: str, monkeypatch: pytest.MonkeyPatch
) -> SuiteRun:
    """The servers the suite starts join the session's Ray instead of starting one each."""
    monkeypatch.setenv("SHARDSERVE_RAY_ADDRESS", ray_address)
    return bench
