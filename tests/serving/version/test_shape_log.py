"""The server logs each (rows, length) shape a stage runs for the first time, from the stats poll."""

from __future__ import annotations

import logging

import pytest

from serving.version.shape_log import ShapeLog


def _report(stage: int, keys: list[str], replica: int = 0) -> dict[str, object]:
    shapes = {key: {"ewma_ms": 1.0, "count": 1} for key in keys}
    return {"replica": replica, "stage_index": stage, "compute_by_shape": shapes}


def test_new_shapes_are_logged_once_per_stage(caplog: pytest.LogCaptureFixture) -> None:
    shapes = ShapeLog()
    with caplog.at_level(logging.INFO, logger="shardserve"):
        shapes.observe([_report(0, ["8,64", "1,16"]), _report(1, ["8,64"])])
        shapes.observe([_report(0, ["8,64", "1,16"]), _report(1, ["8,64"])])  # nothing new
        shapes.observe([_report(0, ["8,64", "1,16", "4,32"]), {"stage_index": 1}])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "stage 0 (replica 0) ran new shape(s) 1x16, 8x64; 2 distinct (rows x length) so far",
        "stage 1 (replica 0) ran new shape(s) 8x64; 1 distinct (rows x length) so far",
        "stage 0 (replica 0) ran new shape(s) 4x32; 3 distinct (rows x length) so far",
    ]


def test_a_model_without_a_length_logs_row_counts(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shardserve"):
        ShapeLog().observe([_report(0, ["16,0"], replica=1)])
    assert [r.getMessage() for r in caplog.records] == [
        "stage 0 (replica 1) ran new shape(s) 16 rows; 1 distinct (rows x length) so far"
    ]
