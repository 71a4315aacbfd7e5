"""The batching settings: validation that names the bad value, the sizes a batch is padded to."""

from __future__ import annotations

from typing import Any

import pytest

from serving.batching.settings import BatchSettings


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an integer >= 1, got 0"),
        ({"max_batch_size": 2.5}, "max_batch_size must be an integer >= 1, got 2.5"),
        ({"max_inflight_batches": 0}, "max_inflight_batches must be an integer >= 1, got 0"),
        ({"max_queue_rows": True}, "max_queue_rows must be an integer >= 1, got True"),
        ({"pipeline_depth": 0}, "pipeline_depth must be an integer >= 1, got 0"),
        ({"pipeline_stages": 0}, "pipeline_stages must be an integer >= 1, got 0"),
        ({"fill_while_busy": 1}, "fill_while_busy must be true or false, got 1"),
        (
            {"batch_timeout_ms": -1},
            "batch_timeout_ms must be a number >= 0 or 'auto', got -1",
        ),
        (
            {"batch_timeout_ms": float("nan")},
            "batch_timeout_ms must be a number >= 0 or 'auto', got nan",
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
        BatchSettings(**changes)
    assert str(info.value) == message


def test_default_sizes_are_powers_of_two_plus_the_maximum() -> None:
    assert BatchSettings().padded_sizes() == (1, 2, 4, 8, 16, 32)
    assert BatchSettings(max_batch_size=24).padded_sizes() == (1, 2, 4, 8, 16, 24)


def test_allowed_sizes_always_include_the_maximum() -> None:
    policy = BatchSettings(max_batch_size=12, allowed_batch_sizes=(10, 3, 3))
    assert policy.padded_sizes() == (3, 10, 12)
    assert [policy.padded_size(n) for n in (1, 3, 4, 10, 11, 12)] == [3, 3, 10, 10, 12, 12]


def test_padded_size_rejects_rows_outside_a_batch() -> None:
    with pytest.raises(ValueError, match="a batch holds 1 to 32 rows, got 33"):
        BatchSettings().padded_size(33)


def test_auto_policy_is_a_none_timeout() -> None:
    assert BatchSettings(batch_timeout_ms="auto").is_auto
    assert not BatchSettings(batch_timeout_ms=0).is_auto


def test_without_padding_a_batch_runs_at_its_row_count() -> None:
    policy = BatchSettings(max_batch_size=32, pad_batches=False)
    assert [policy.padded_size(n) for n in (1, 3, 17, 32)] == [1, 3, 17, 32]
    assert policy.padded_sizes() == (1, 2, 4, 8, 16, 32)  # the caps the SLO rule picks from
    assert BatchSettings(max_batch_size=32).padded_size(17) == 32
    with pytest.raises(ValueError, match="pad_batches must be true or false"):
        BatchSettings(pad_batches=1)  # type: ignore[arg-type]


def test_batches_enter_one_first_stage_per_replica() -> None:
    assert BatchSettings(pipeline_depth=6, pipeline_stages=3).entry_stages == 2
    assert BatchSettings().entry_stages == 1
