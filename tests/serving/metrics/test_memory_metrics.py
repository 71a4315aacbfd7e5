"""The stage actors' memory, planned beside measured: one log line per stage at start-up and
gauges in /metrics (shardserve_stage_memory_bytes{replica, stage, kind})."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fakes import FakeRunner
from prometheus_client.parser import text_string_to_metric_families

from serving.metrics.series import Metrics
from serving.settings.config import Settings
from serving.version.life import VersionState
from serving.version.served import ServedModel

MiB = 2**20


def memory(planned: int, measured: int, gpu: dict[str, int] | None = None) -> dict[str, Any]:
    return {
        "planned_peak_bytes": planned,
        "rss_bytes": measured,
        "rss_peak_bytes": measured + MiB,
        "gpu": gpu,
    }


class MeasuredRunner(FakeRunner):
    async def stats(self) -> list[dict[str, Any]]:
        return [
            {"replica": 0, "stage_index": 0, "calls": 0, "memory": memory(800 * MiB, 900 * MiB)},
            {
                "replica": 0,
                "stage_index": 1,
                "calls": 0,
                "memory": memory(1000 * MiB, 500 * MiB, {"current": 7 * MiB, "peak": 9 * MiB}),
            },
        ]


def memory_gauges(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    text = metrics.render().decode()
    return {
        (m.labels["replica"], m.labels["stage"], m.labels["kind"]): m.value
        for family in text_string_to_metric_families(text)
        if family.name == "shardserve_stage_memory_bytes"
        for m in family.samples
    }


def test_metrics_expose_planned_and_measured_per_stage() -> None:
    metrics = Metrics()
    metrics.for_model("m", "1").set_stage_stats(
        [{"replica": 1, "stage_index": 2, "memory": memory(3 * MiB, 4 * MiB)}, {"stage_index": 3}]
    )
    # A row without a memory report (an older actor) gives no gauge.
    assert memory_gauges(metrics) == {
        ("1", "2", "planned"): 3 * MiB,
        ("1", "2", "measured"): 4 * MiB,
        ("1", "2", "measured_peak"): 5 * MiB,
    }


def test_metrics_expose_the_weights_and_the_tensorflow_baseline() -> None:
    metrics = Metrics()
    report = {
        **memory(900 * MiB, 1100 * MiB),
        "weight_bytes": 320 * MiB,
        "rss_marks": {"start": 100 * MiB, "tensorflow": 760 * MiB, "loaded": 1100 * MiB},
    }
    metrics.for_model("m", "1").set_stage_stats([{"stage_index": 0, "memory": report}])
    gauges = memory_gauges(metrics)
    # What the stage itself holds, per byte of its weights, reads off one scrape.
    assert gauges[("0", "0", "weights")] == 320 * MiB
    assert gauges[("0", "0", "tensorflow_baseline")] == 760 * MiB
    assert gauges[("0", "0", "measured")] - gauges[("0", "0", "tensorflow_baseline")] == 340 * MiB


async def test_start_up_logs_plan_vs_measured_per_stage(caplog: pytest.LogCaptureFixture) -> None:
    model = ServedModel("fake", Settings(), Metrics())

    async def factory(_: Settings) -> MeasuredRunner:
        return MeasuredRunner()

    with caplog.at_level(logging.INFO, logger="shardserve"):
        await model.load(factory, None)
    assert model.state is not VersionState.FAILED, model.reason
    lines = [r.getMessage() for r in caplog.records if "memory: planned" in r.getMessage()]
    assert lines == [
        "stage 0 (replica 0) memory: planned peak 800.0 MiB, measured RSS 900.0 MiB (1.12x the "
        "plan; process peak 901.0 MiB)",
        "stage 1 (replica 0) memory: planned peak 1000.0 MiB, measured RSS 500.0 MiB (0.50x the "
        "plan; process peak 501.0 MiB), GPU peak 9.0 MiB",
    ]
    gauges = memory_gauges(model.server_metrics)
    assert gauges[("0", "1", "gpu_measured_peak")] == 9 * MiB
    assert gauges[("0", "0", "planned")] == 800 * MiB
    if model.batcher is not None:
        await model.batcher.stop()
