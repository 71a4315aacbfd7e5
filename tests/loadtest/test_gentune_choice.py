"""The generation tuner's pieces without a server: its choice over a table of points (pure), its
report files, the operator's workload, and a window of streams in figures."""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

import pytest

from loadtest.genchoice import GenPoint, Targets, choose, medians, pick, recommend
from loadtest.genreport import PLOT, write_all
from loadtest.gentune import parse_budgets, parse_running, plan
from loadtest.sse import StreamResult, stream_summary
from loadtest.tune import Load
from loadtest.workload import Workload, load_workload

TARGETS = Targets(ttft_p95_ms=500, tpot_p95_ms=50)


def pt(
    load: str,
    setting: tuple[str, int, int | None],
    tokens_per_s: float,
    ttft_p95: float | None,
    tpot_p95: float | None,
    *,
    failures: int = 0,
    streams: int = 100,
) -> GenPoint:
    wait, running, budget = setting
    return GenPoint(
        load, wait, running, budget, streams, failures, tokens_per_s, streams / 10,
        None if ttft_p95 is None else ttft_p95 / 2, ttft_p95,
        None if tpot_p95 is None else tpot_p95 / 2, tpot_p95,
    )  # fmt: skip


A = ("auto", 8, None)
B = ("20", 8, 64)
C = ("auto", 4, 64)


def test_most_tokens_within_both_targets_wins() -> None:
    points = [pt("c=8", A, 900, 700, 40), pt("c=8", B, 800, 400, 45), pt("c=8", C, 500, 200, 30)]
    [choice] = choose(points, TARGETS)
    assert (choice.winner.setting, choice.meets) == (B, True)  # A is faster but its TTFT misses
    assert choice.note == "most tokens/s with TTFT p95 <= 500 ms and TPOT p95 <= 50 ms"


def test_a_tpot_past_its_target_misses_too() -> None:
    points = [pt("c=8", A, 900, 300, 60), pt("c=8", C, 500, 300, 49)]
    assert pick(points, TARGETS).winner.setting == C


def test_when_none_meets_the_one_that_misses_least_is_given_and_said() -> None:
    # A: worst figure 1.4x its target (TTFT), B: 1.2x (TPOT), C: 2x.
    points = [pt("c=8", A, 900, 700, 40), pt("c=8", B, 800, 400, 60), pt("c=8", C, 500, 1000, 10)]
    choice = pick(points, TARGETS)
    assert (choice.winner.setting, choice.meets) == (B, False)
    assert choice.note.startswith("no setting meets TTFT p95 <= 500 ms and TPOT p95 <= 50 ms")


def test_failed_streams_or_missing_figures_never_meet() -> None:
    points = [
        pt("c=8", A, 900, 100, 10, failures=5),  # 5% failed: its fast refusals flatter it
        pt("c=8", B, 800, None, None),  # no stream gave a first token
        pt("c=8", C, 100, 400, 40),
    ]
    assert pick(points, TARGETS).winner.setting == C
    assert not points[0].meets(TARGETS) and not points[1].meets(TARGETS)


def test_without_targets_the_most_tokens_win() -> None:
    points = [pt("c=8", A, 900, 9000, 900), pt("c=8", C, 500, 100, 10)]
    assert pick(points, Targets()).winner.setting == A
    assert Targets().describe() == "no latency target (most tokens/s wins)"


def test_recommend_meets_every_level_and_gives_up_the_least() -> None:
    points = [
        pt("c=4", A, 500, 200, 30), pt("c=4", B, 450, 250, 30), pt("c=4", C, 300, 100, 20),
        # At c=16 A misses its TTFT target: B is the one that meets at both levels.
        pt("c=16", A, 1000, 900, 45), pt("c=16", B, 950, 480, 45), pt("c=16", C, 600, 300, 30),
    ]  # fmt: skip
    point, meets, why = recommend(points, TARGETS)
    assert (point.setting, meets) == (B, True)
    assert "keeps at least 90% of the best tokens/s" in why


def test_recommend_when_none_meets_everywhere_takes_the_one_that_misses_least() -> None:
    points = [
        pt("c=4", A, 500, 200, 30), pt("c=4", C, 300, 100, 20),
        pt("c=16", A, 1000, 1500, 45), pt("c=16", C, 600, 600, 30),
    ]  # fmt: skip
    point, meets, why = recommend(points, TARGETS)
    assert (point.setting, meets) == (C, False)
    assert "misses it least (its worst figure is 1.20x its target)" in why


def test_recommend_refuses_an_empty_table() -> None:
    with pytest.raises(ValueError, match="no points measured"):
        recommend([], TARGETS)


def test_medians_over_repeats() -> None:
    runs = [pt("c=8", A, v, t, 40) for v, t in ((100, 300), (300, 900), (200, 600))]
    [point] = medians(runs)
    assert (point.tokens_per_s, point.ttft_p95_ms, point.runs, point.streams) == (200, 600, 3, 300)


def test_the_report_files(tmp_path: Path) -> None:
    points = [pt("c=8", A, 900, 700, 40), pt("c=8", B, 800, 400, 45)]
    paths = write_all(points, TARGETS, tmp_path, header="a test")
    assert {p.name for p in paths} == {
        "results.csv", "runs.csv", "report.md", PLOT, "recommended.toml"
    }  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert "| 20 | 8 | 64 | 800.0 |" in report and "**winner**" in report
    assert "`prefill_timeout_ms = 20`, `max_running_sequences = 8`" in report
    config = tomllib.loads((tmp_path / "recommended.toml").read_text())["shardserve"]
    assert config == {
        "prefill_timeout_ms": 20.0, "max_running_sequences": 8, "prefill_budget_tokens": 64
    }  # fmt: skip
    with (tmp_path / "results.csv").open() as f:
        assert [r["prefill_budget_tokens"] for r in csv.DictReader(f)] == ["", "64"]
    assert (tmp_path / PLOT).stat().st_size > 0


def test_the_sweep_plan_and_its_options() -> None:
    assert parse_budgets("none, 64,64") == [None, 64]
    assert parse_running("") is None and parse_running("4,8") == [4, 8]
    with pytest.raises(ValueError, match="integers >= 1 or 'none', got 'zero'"):
        parse_budgets("zero")
    from loadtest.gentune import GenTuneConfig

    config = GenTuneConfig(
        url="http://x", model_name="gpt", out=Path("o"), workload=Workload(),
        loads=[Load("c=8", 8)], timeouts=["auto", "20"], running=None, budgets=[None, 64],
        duration_s=1, repeats=2,
    )  # fmt: skip
    runs = plan(config, kv_slots=8)
    assert len(runs) == 16  # 2 x 2 x 2, twice, going round
    assert [s for _, s in runs[:8]] == [s for _, s in runs[8:]]
    assert {s[1] for _, s in runs} == {8, 4}  # kv_slots and half of it by default
    config.running = [16]
    with pytest.raises(ValueError, match="past the server's kv_slots"):
        plan(config, kv_slots=8)


def test_a_workload_file_and_its_overrides(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('prompt_tokens = [2, 3]\nvocabulary = 10\nmax_tokens = 5\nroute = "v2"\n')
    workload = load_workload(path, max_tokens="4:6")
    assert (workload.prompt_tokens, workload.max_tokens, workload.route) == ((2, 3), (4, 6), "v2")
    bodies = [json.loads(b) for b in workload.bodies(20, "gpt")]
    assert all(2 <= len(b["input_ids"]) <= 3 and max(b["input_ids"]) < 10 for b in bodies)
    assert all(4 <= b["parameters"]["max_tokens"] <= 6 for b in bodies)
    assert workload.path("gpt") == "/v2/models/gpt/generate_stream"
    assert bodies == [json.loads(b) for b in workload.bodies(20, "gpt")]  # seeded
    given = tmp_path / "w.json"
    given.write_text(json.dumps({"prompts": ["hello", [5, 6]], "max_tokens": [1, 2]}))
    opened = [json.loads(b) for b in load_workload(given).bodies(10, "gpt")]
    assert {str(b["prompt"]) for b in opened} <= {"hello", "[5, 6]"}
    assert all(b["stream"] for b in opened)
    path.write_text("prompt_token = [1, 2]\n")
    with pytest.raises(ValueError, match="unknown key 'prompt_token'"):
        load_workload(path)
    with pytest.raises(ValueError, match="stop = false needs route = 'v2'"):
        Workload(stop=False)
    with pytest.raises(ValueError, match=r"max_tokens wants N or MIN:MAX, got 'lots'"):
        load_workload(None, max_tokens="lots")


def test_a_window_of_streams_in_figures() -> None:
    def stream(ttft: float, tokens: int, error: str | None = None) -> StreamResult:
        return StreamResult(0.0, 2.0, ttft, ttft + 0.01 * (tokens - 1), tokens, tokens, error)

    results = [stream(0.1 * (i + 1), 11) for i in range(19)] + [stream(0.1, 0, "refused")]
    figures = stream_summary(results, seconds=10.0)
    assert (figures["streams"], figures["failures"], figures["tokens"]) == (20, 1, 209)
    assert figures["tokens_per_s"] == pytest.approx(20.9)
    assert figures["ttft_p50_ms"] == pytest.approx(1000.0)
    assert figures["ttft_p95_ms"] == pytest.approx(1900.0)
    assert figures["tpot_p95_ms"] == pytest.approx(10.0)
    assert stream_summary([], 1.0)["ttft_p95_ms"] is None


def test_a_v2_stream_ends_at_its_finish_reason_and_counts_its_ids() -> None:
    from loadtest.sse import measure_stream

    def event(ids: list[int], finish: str | None) -> list[str]:
        chunk = {"text_output": "x" * len(ids), "output_ids": ids, "finish_reason": finish}
        return [f"data: {json.dumps(chunk)}\n", "\n"]

    ticks = iter(float(t) for t in range(100))
    lines = event([4], None) + event([5, 6], None) + event([], "length")
    result = measure_stream(lines, 0.0, lambda: next(ticks))
    assert (result.error, result.tokens) == (None, 3)
    cut = measure_stream(event([4], None), 0.0, lambda: next(ticks))
    assert cut.error == "the stream ended without data: [DONE]"
