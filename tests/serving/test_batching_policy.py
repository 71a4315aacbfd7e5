"""Batching policy validation and sizes, and the run-time model behind the auto policy's SLO."""

from __future__ import annotations

from typing import Any

import pytest

from serving.batching_policy import BatchingPolicy, RunTimeModel


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer >= 1, got 2.5"),
        ({"max_inflight_batches": 0}, "max_inflight_batches must be an integer >= 1, got 0"),
        ({"max_queue_rows": True}, "max_queue_rows must be an integer >= 1, got True"),
        ({"pipeline_depth": 0}, "pipeline_depth must be an integer >= 1, got 0"),
        (
            {"batch_timeout_ms": -1},
            "batch_timeout_ms must be a number >= 0 or None (auto), got -1",
        ),
        (
            {"batch_timeout_ms": float("nan")},
            "batch_timeout_ms must be a number >= 0 or None (auto), got nan",
        ),
        ({"slo_p99_ms": 0}, "slo_p99_ms must be a number > 0 or None, got 0"),
        (
            {"max_queue_rows": 16},
            "max_queue_rows must be >= max_batch_size (32) so that a batch can fill, got 16",
        ),
        (
            {"allowed_batch_sizes": (8, 64)},
            "allowed_batch_sizes must be a tuple of integers between 1 and max_batch_size (32), "
            "got (8, 64)",
        ),
        (
            {"allowed_batch_sizes": [8]},
            "allowed_batch_sizes must be a tuple of integers between 1 and max_batch_size (32), "
            "got [8]",
        ),
    ],
)
def test_invalid_policies_name_the_value(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        BatchingPolicy(**changes)
    assert str(info.value) == message


def test_default_sizes_are_powers_of_two_plus_the_maximum() -> None:
    assert BatchingPolicy().batch_sizes() == (1, 2, 4, 8, 16, 32)
    assert BatchingPolicy(max_batch_size=24).batch_sizes() == (1, 2, 4, 8, 16, 24)


def test_allowed_sizes_always_include_the_maximum() -> None:
    policy = BatchingPolicy(max_batch_size=12, allowed_batch_sizes=(10, 3, 3))
    assert policy.batch_sizes() == (3, 10, 12)
    assert [policy.padded_size(n) for n in (1, 3, 4, 10, 11, 12)] == [3, 3, 10, 10, 12, 12]


def test_padded_size_rejects_rows_outside_a_batch() -> None:
    with pytest.raises(ValueError, match="a batch holds 1 to 32 rows, got 33"):
        BatchingPolicy().padded_size(33)


def test_auto_policy_is_a_none_timeout() -> None:
    assert BatchingPolicy(batch_timeout_ms=None).is_auto
    assert not BatchingPolicy(batch_timeout_ms=0).is_auto


def test_run_time_model_averages_and_extrapolates() -> None:
    model = RunTimeModel()
    assert model.predict(8) is None
    model.observe(8, 0.10)
    model.observe(8, 0.20)
    assert model.predict(8) == pytest.approx(0.12)  # EWMA: 0.10 + 0.2 * (0.20 - 0.10)
    assert model.predict(16) == pytest.approx(0.24)  # linear from the nearest measured size


def test_largest_size_within_budget() -> None:
    model = RunTimeModel()
    sizes = (1, 2, 4, 8)
    assert model.largest_within(0.0, sizes) == 8  # nothing measured: no cap
    model.observe(1, 0.01)
    model.observe(8, 0.5)
    assert model.largest_within(0.1, sizes) == 4
    assert model.largest_within(1.0, sizes) == 8
    assert model.largest_within(0.001, sizes) is None


def test_run_time_model_keeps_a_recent_average_over_all_sizes() -> None:
    model = RunTimeModel()
    assert model.recent_s is None
    model.observe(1, 1.0)
    model.observe(8, 2.0)
    assert model.recent_s == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))
    assert model.predict(1) == 1.0 and model.predict(8) == 2.0
