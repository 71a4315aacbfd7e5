"""The run-time model behind the auto policy's SLO: a batch's cost per size, from the driver's wall
times and the stage actors' compute reports."""

from __future__ import annotations

import pytest

from serving.batching.cost import RunTimeModel


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


def _report(stage: int, ms_by_rows: dict[int, float], replica: int = 0) -> dict[str, object]:
    """One stage actor's stats() answer, as the server's poll passes it on."""
    by_rows = {rows: {"ewma_ms": ms, "count": 3} for rows, ms in ms_by_rows.items()}
    return {"replica": replica, "stage_index": stage, "compute_by_rows": by_rows}


def test_run_time_model_predicts_from_the_stages_compute_not_the_wall_time() -> None:
    model = RunTimeModel()
    # Under load the driver saw 8-row batches take 200 ms: most of it queueing in the pipeline.
    model.observe(8, 0.200)
    assert model.predict(8) == pytest.approx(0.200)  # no report yet: the wall time stands in
    model.observe_compute(
        [
            _report(0, {8: 10.0, 16: 18.0}),
            _report(1, {8: 30.0, 16: 50.0}),
            _report(1, {8: 20.0, 16: 40.0}, replica=1),  # replicas of a stage are averaged
        ]
    )
    # Latency: the stages summed (10 + 25 ms) plus the hop overhead; none measured alone yet,
    # so the least wall-minus-compute seen since the report counts (none yet: 0).
    assert model.predict(8) == pytest.approx(0.035)
    assert model.predict(16) == pytest.approx(0.063)
    # Throughput: the slowest stage.
    assert model.bottleneck_s(8) == pytest.approx(0.025)
    assert model.bottleneck_s(32) == pytest.approx(0.090)  # 45 ms x 32 / 16: linear guess
    # A batch sent into an idle pipeline took 38 ms: 3 ms of hops on top of 35 ms of compute.
    model.observe(8, 0.038, alone=True)
    # More batches queued behind others under load do not move the estimate.
    for _ in range(5):
        model.observe(8, 0.300)
    assert model.hop_s == pytest.approx(0.003)
    assert model.predict(8) == pytest.approx(0.038)


def test_a_size_a_stage_has_not_run_is_not_predicted_from_compute() -> None:
    model = RunTimeModel()
    model.observe_compute([_report(0, {4: 5.0, 8: 9.0}), _report(1, {4: 6.0})])
    assert model.predict(4) == pytest.approx(0.011)
    assert model.predict(8) == pytest.approx(0.022)  # 8 only at stage 0: scaled from 4


def test_a_stale_size_runs_once_to_be_measured_again() -> None:
    model = RunTimeModel(stale_s=10.0)
    sizes = (1, 2, 4, 8)
    model.observe(1, 0.01, now=0.0)
    model.observe(8, 0.5, now=0.0)  # once slow (a noisy neighbour, say)
    for now in (1.0, 5.0):
        model.observe(1, 0.01, now=now)
        assert model.largest_within(0.1, sizes, now=now, queued=8) == 4
    model.observe(4, 0.04, now=9.0)
    # 8 has not run for 10 s: one batch may take 8 rows, then the cap holds again.
    assert model.largest_within(0.1, sizes, now=10.0, queued=8) == 8
    assert model.largest_within(0.1, sizes, now=10.5, queued=8) == 4
    # Not with too few rows queued to make the bigger batch: the probe is not spent on them.
    assert model.largest_within(0.1, sizes, now=21.0, queued=4) == 4
    assert model.largest_within(0.1, sizes, now=21.0, queued=8) == 8
    # Measured again (and again: an EWMA) and fast now: it fits.
    for k in range(15):
        model.observe(8, 0.05, now=21.1 + k / 100)
    assert model.largest_within(0.1, sizes, now=22.0, queued=8) == 8


def test_estimates_are_kept_per_length_bucket_and_err_long_between_them() -> None:
    model = RunTimeModel()
    model.observe_compute(
        [
            {"stage_index": 0, "compute_by_shape": {"8,16": {"ewma_ms": 4.0, "count": 2},
                                                    "8,128": {"ewma_ms": 40.0, "count": 2}}},
            {"stage_index": 1, "compute_by_shape": {"8,16": {"ewma_ms": 6.0, "count": 2},
                                                    "8,128": {"ewma_ms": 60.0, "count": 2}}},
        ]
    )  # fmt: skip
    assert model.predict(8, 16) == pytest.approx(0.010)
    assert model.predict(8, 128) == pytest.approx(0.100)
    assert model.bottleneck_s(8, 128) == pytest.approx(0.060)
    # 64 was never run: priced at the next longer bucket measured, not the shorter one.
    assert model.predict(8, 64) == pytest.approx(0.100)
    # Longer than any measured: scaled up linearly in length from the longest.
    assert model.predict(8, 256) == pytest.approx(0.200)
    assert model.lengths() == [16, 128]
    view = model.view((8,))
    assert view["by_length"]["16"]["latency"]["8"] == pytest.approx(10.0)
    assert view["latency"]["8"] == pytest.approx(100.0)  # the longest measured


def test_a_batch_limit_under_an_slo_depends_on_the_length() -> None:
    model = RunTimeModel()
    for size, ms16, ms128 in ((1, 1.0, 8.0), (4, 2.0, 30.0), (8, 3.0, 60.0)):
        model.observe(size, ms16 / 1000, length=16)
        model.observe(size, ms128 / 1000, length=128)
    assert model.largest_within(0.035, (1, 4, 8), length=16) == 8
    assert model.largest_within(0.035, (1, 4, 8), length=128) == 4


def test_the_first_stage_compute_comes_from_its_own_reports_only() -> None:
    model = RunTimeModel()
    model.observe(8, 0.200)
    assert model.entry_s(8) is None  # the wall time holds the whole pipeline's queueing
    model.observe_compute([_report(0, {8: 10.0}), _report(0, {8: 20.0}, replica=1)])
    assert model.entry_s(8) == pytest.approx(0.015)  # replicas of the stage averaged
    model.observe_compute([_report(0, {8: 10.0}), _report(1, {8: 30.0})])
    assert model.entry_s(8) == pytest.approx(0.010)
    assert model.entry_s(16) == pytest.approx(0.020)  # linear from the nearest size
