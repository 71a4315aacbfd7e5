"""A stage's compute per row count and per (rows, length) shape, and one log line per new shape."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from shards.actor.compute_log import ComputeLog
from shards.signature import TensorSpec

FEATURES = TensorSpec("features", (8,), "float32")
TOKENS = TensorSpec("tokens", (None,), "int32")
MASK = TensorSpec("mask", (None,), "bool")


def batch(rows: int, length: int) -> list[np.ndarray]:
    return [np.zeros((rows, 8), "float32"), np.zeros((rows, length), "int32")]


def test_each_shape_is_kept_by_rows_and_length(caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeLog(1, [FEATURES, TOKENS])
    with caplog.at_level(logging.INFO, logger="shards.actor.compute_log"):
        for rows, length, ms in [(8, 64, 10.0), (8, 64, 20.0), (8, 32, 4.0), (2, 64, 3.0)]:
            compute.record(batch(rows, length), ms / 1000.0)

    stats = compute.stats()
    assert stats["compute_by_shape"] == {
        "8,64": {"ewma_ms": pytest.approx(12.0), "count": 2},
        "8,32": {"ewma_ms": pytest.approx(4.0), "count": 1},
        "2,64": {"ewma_ms": pytest.approx(3.0), "count": 1},
    }
    assert stats["compute_by_rows"][8]["count"] == 3
    assert stats["shapes_run"] == 3
    # Once per new shape, not per batch.
    assert [r.getMessage() for r in caplog.records] == [
        "stage 1 ran a new shape: 8 rows x 64 positions (1 distinct so far)",
        "stage 1 ran a new shape: 8 rows x 32 positions (2 distinct so far)",
        "stage 1 ran a new shape: 2 rows x 64 positions (3 distinct so far)",
    ]


def test_a_stage_of_known_dimensions_has_length_zero(caplog: pytest.LogCaptureFixture) -> None:
    compute = ComputeLog(0, [FEATURES])
    with caplog.at_level(logging.INFO, logger="shards.actor.compute_log"):
        compute.record([np.zeros((4, 8), "float32")], 0.001)

    assert set(compute.stats()["compute_by_shape"]) == {"4,0"}
    assert caplog.records[0].getMessage() == "stage 0 ran a new shape: 4 rows (1 distinct so far)"


def test_the_length_is_read_from_the_first_unknown_dimension() -> None:
    compute = ComputeLog(0, [FEATURES, MASK, TOKENS])
    mask = np.zeros((3, 5), bool)
    assert compute.length_of([np.zeros((3, 8)), mask, np.zeros((3, 9), "int32")]) == 5
