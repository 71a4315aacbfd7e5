"""The tuner's choice: per load level, the fastest setting within the SLO; auto vs fixed."""

from __future__ import annotations

import pytest

from loadtest.choice import Point, choose, compare_auto, medians, pick, recommend


def pt(
    load: str,
    timeout: str,
    rps: float,
    p99: float,
    *,
    failures: int = 0,
    requests: int = 1000,
    batch: int | None = None,
) -> Point:
    return Point(load, timeout, batch, requests, failures, rps, p99 / 2, p99 * 0.9, p99)


def test_fastest_setting_within_the_slo_wins() -> None:
    points = [pt("16", "0", 300, 40), pt("16", "5", 500, 90), pt("16", "20", 600, 150)]
    [choice] = choose(points, slo_p99_ms=100)
    assert (choice.winner.timeout, choice.meets_slo) == ("5", True)
    assert choice.note == "highest throughput with p99 <= 100 ms"


def test_without_an_slo_the_fastest_wins() -> None:
    points = [pt("16", "0", 300, 40), pt("16", "20", 600, 150)]
    assert pick(points, None).winner.timeout == "20"


def test_when_none_meets_the_slo_the_lowest_p99_is_given_and_said() -> None:
    points = [pt("64", "0", 300, 140), pt("64", "5", 500, 120), pt("64", "20", 600, 130)]
    [choice] = choose(points, slo_p99_ms=100)
    assert (choice.winner.timeout, choice.meets_slo) == ("5", False)
    assert choice.note == "no setting meets p99 <= 100 ms; lowest p99 shown"


def test_a_setting_that_fails_requests_does_not_meet_the_slo() -> None:
    points = [pt("64", "0", 300, 50), pt("64", "5", 900, 20, failures=200)]
    assert pick(points, 100).winner.timeout == "0"


def test_ties_on_throughput_go_to_the_lower_p99() -> None:
    points = [pt("4", "2", 500, 30), pt("4", "5", 500, 20)]
    assert pick(points, 100).winner.timeout == "5"


def test_one_choice_per_load_level_in_measured_order() -> None:
    points = [
        pt("4", "0", 200, 10),
        pt("4", "10", 150, 20),
        pt("64", "0", 300, 90),
        pt("64", "10", 700, 80),
    ]
    choices = choose(points, slo_p99_ms=100)
    assert [(c.load, c.winner.timeout) for c in choices] == [("4", "0"), ("64", "10")]


def test_pick_of_nothing_names_the_load() -> None:
    with pytest.raises(ValueError, match="no points measured at load '8'"):
        pick([], 100, "8")


def test_auto_is_compared_with_the_best_fixed_timeout() -> None:
    points = [
        pt("4", "0", 200, 10),
        pt("4", "auto", 190, 10.5),
        pt("64", "0", 300, 90),
        pt("64", "10", 700, 80),
        pt("64", "auto", 600, 70),
    ]
    low, high = compare_auto(points, slo_p99_ms=100)
    assert (low.best_fixed.timeout, low.rps_ratio, low.p99_ratio, low.ok) == (
        "0",
        pytest.approx(0.95),
        pytest.approx(1.05),
        True,
    )
    assert (high.best_fixed.timeout, high.ok) == ("10", False)
    assert high.rps_ratio == pytest.approx(600 / 700)


def test_recommend_gives_up_the_least_throughput_anywhere() -> None:
    points = [
        pt("4", "0", 200, 10),
        pt("4", "10", 120, 20),
        pt("4", "auto", 190, 10),
        pt("64", "0", 300, 90),
        pt("64", "10", 700, 80),
        pt("64", "auto", 650, 70),
    ]
    setting, why = recommend(points, slo_p99_ms=100)
    assert setting == ("auto", None)
    assert (
        why
        == "auto keeps at least 93% of the best throughput at every load level with p99 <= 100 ms"
    )


def test_recommend_prefers_settings_that_meet_the_slo_everywhere() -> None:
    points = [
        pt("4", "0", 200, 10),
        pt("4", "20", 210, 40),
        pt("64", "0", 300, 90),
        pt("64", "20", 700, 150),
    ]
    assert recommend(points, slo_p99_ms=100)[0] == ("0", None)
    setting, why = recommend(points, slo_p99_ms=5)
    assert setting == ("20", None)
    assert why.startswith("no setting meets the SLO at every load level; 20 ms keeps")


def test_max_batch_size_is_part_of_the_setting() -> None:
    points = [pt("8", "5", 300, 20, batch=16), pt("8", "5", 400, 30, batch=64)]
    winner = pick(points, 100).winner
    assert (winner.setting, winner.label) == (("5", 64), "5 ms, batch 64")


def test_medians_take_each_figure_over_the_runs_of_one_setting() -> None:
    runs = [
        pt("8", "5", 200, 60, failures=1),
        pt("8", "auto", 180, 70),
        pt("8", "5", 100, 90),  # one disturbed run
        pt("8", "auto", 190, 50),
        pt("8", "5", 210, 55),
        pt("16", "5", 400, 80),
    ]
    five, auto, other = medians(runs)
    assert (five.load, five.timeout, five.runs) == ("8", "5", 3)
    assert (five.rps, five.p99_ms) == (200, 60)  # the disturbed run moves neither
    assert (five.requests, five.failures) == (3000, 1)
    assert (auto.runs, auto.rps, auto.p99_ms) == (2, 185, 60)  # an even count: the mean of two
    assert (other.load, other.runs, other.rps) == ("16", 1, 400)


def test_medians_of_medians_count_every_run() -> None:
    once = medians([pt("8", "0", 100, 50), pt("8", "0", 120, 40)])
    [again] = medians([*once, pt("8", "0", 90, 70)])
    assert again.runs == 3
