"""The generation bench's streamed path (issue 40): how a stream's TTFT is read from its timed
lines, the bodies both paths send, the medians over rounds and the streamed / plain ratio, the
table; and one tiny run of ``--streamed`` against a real server (nothing here is timed)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from bench.load.sseload import SSELoad, streamed, tally, timed_stream
from bench.suites.generate.report import render
from bench.suites.generate.run import GeneratePlan
from bench.suites.generate.streamed import (
    combined,
    completion_bodies,
    record,
    render_streamed,
    summarize_streamed,
)
from tests.bench.suiterun import SuiteRun


def _event(obj: object) -> list[bytes]:
    return [b"data: " + orjson.dumps(obj) + b"\n", b"\n"]


def _stamped(*events: list[bytes], start: float = 10.0) -> list[tuple[bytes, float]]:
    """The events' lines, line k arriving at ``start`` + k + 1."""
    lines = [line for event in events for line in event]
    return [(line, start + k + 1) for k, line in enumerate(lines)]


def test_a_streams_ttft_is_its_first_event_with_text_at_the_line_that_ends_it() -> None:
    lines = _stamped(
        [b": a comment\n"],
        _event({"choices": [{"index": 0, "text": ""}]}),  # no text yet
        _event({"choices": [{"index": 0, "text": "h"}]}),
        _event({"choices": [{"index": 0, "text": "ello"}]}),  # two tokens coalesced
        _event({"choices": [], "usage": {"completion_tokens": 3}}),
        [b"data: [DONE]\n", b"\n"],
    )
    result = timed_stream(lines, started=10.0)
    assert result.error is None
    # The comment is line 1, the empty chunk lines 2-3, the first text's blank line line 5.
    assert result.ttft_ms == pytest.approx(5000.0)
    assert result.tokens == 3  # the usage chunk's count, not the events'
    assert result.ended == 10.0 + len(lines)  # [DONE]'s blank line


def test_a_stream_cut_short_or_ending_in_an_error_event_is_a_failure() -> None:
    cut = _stamped(_event({"choices": [{"index": 0, "text": "a"}]}))
    assert timed_stream(cut, started=0.0).error == "the stream ended without data: [DONE]"
    error = {"error": {"message": "past the deadline", "code": "deadline_exceeded"}}
    failed = _stamped(
        _event({"choices": [{"index": 0, "text": "a"}]}), _event(error), [b"data: [DONE]\n", b"\n"]
    )
    assert timed_stream(failed, started=0.0).error == "error event: past the deadline"


def test_the_load_counts_failures_and_gives_no_ttft_to_an_answer_without_a_token() -> None:
    done = [
        (3.0, "ok", 0.2, 1.5, 12),
        (1.0, "ok", 0.1, 0.1, 0),  # its first token was the end token: no text
        (2.0, "error event: past the deadline", 0.0, 0.0, 0),
        (4.0, "503", 0.0, 0.0, 0),
    ]
    load = tally(done, stream=True, seconds=5.0)
    assert (load.first_s, load.latencies_s, load.tokens) == ([0.2], [0.1, 1.5], [0, 12])
    assert (load.sent, load.errors, load.seconds) == (4, 2, 5.0)
    assert load.failures == {"error event: past the deadline": 1, "503": 1}


def test_both_paths_send_the_generate_routes_requests_only_the_stream_flags_apart() -> None:
    plan = GeneratePlan(min_prompt=4, max_prompt=8, min_tokens=2, max_tokens=5)
    generate = plan.requests(20, seed=3)
    bodies = completion_bodies(generate, "gpt")
    for seed, (raw, body) in enumerate(zip(generate, bodies, strict=True)):
        request, completion = orjson.loads(raw), orjson.loads(body)
        assert completion == {
            "model": "gpt",
            "prompt": request["input_ids"],
            "max_tokens": request["parameters"]["max_tokens"],
            "temperature": 1.0,  # each its own seed: both paths draw the same tokens
            "seed": seed,
        }
        assert orjson.loads(streamed(body)) == {
            **completion,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def _load(stream: bool, tokens: list[int], seconds: float, first: list[float]) -> SSELoad:
    return SSELoad(
        stream=stream,
        first_s=first,
        latencies_s=[f + 1.0 for f in first],
        tokens=tokens,
        errors=0,
        sent=len(tokens),
        seconds=seconds,
        failures={},
    )


def _streamed_results() -> dict[str, Any]:
    runs = []
    # plain tokens/s 100, 120, 110 (median 110); streamed 90, 118, 104 (median 104).
    for r, (plain, stream) in enumerate([(100, 90), (120, 118), (110, 104)]):
        cpu = {"frontend": 0.1 * (r + 1), "shard_actors": 1.5}
        runs.append(record(_load(False, [plain * 2], 2.0, [0.5, 0.7, 0.9]), r, cpu))
        runs.append(record(_load(True, [stream * 2], 2.0, [0.01, 0.02, 0.03]), r))
    return {"model": "GPT-2 tiny", "streamed": {"clients": 8, "seconds": 20.0, "runs": runs}}


def test_a_round_records_tokens_per_s_and_the_clients_percentiles() -> None:
    r = record(_load(True, [30, 50], 4.0, [0.1, 0.2, 0.3]), 2)
    assert (r["path"], r["round"], r["tokens"], r["tokens_per_s"]) == ("streamed", 2, 80, 20.0)
    assert r["ttft_p50_s"] == pytest.approx(0.2) and r["latency_p50_s"] == pytest.approx(1.2)
    assert record(_load(False, [], 4.0, []), 0)["ttft_p50_s"] is None
    # The server's CPU over the round, per token answered: 0.5 cores x 4 s / 80 tokens.
    with_cpu = record(_load(True, [30, 50], 4.0, [0.1]), 0, {"frontend": 0.5, "shard_actors": 1})
    assert with_cpu["frontend_ms_per_token"] == pytest.approx(25.0)
    assert with_cpu["workers_ms_per_token"] == pytest.approx(50.0)
    assert r["frontend_ms_per_token"] is None  # not sampled


def test_the_summary_takes_each_paths_medians_and_streamed_over_plain() -> None:
    summary = summarize_streamed(_streamed_results()["streamed"])
    plain, stream = summary["paths"]["plain"], summary["paths"]["streamed"]
    assert (plain["tokens_per_s"], stream["tokens_per_s"]) == (110.0, 104.0)
    assert plain["ttft_p50_s"] == pytest.approx(0.7) and stream["rounds"] == 3
    assert summary["ratio"] == pytest.approx(104 / 110)
    assert summary["round_ratios"] == pytest.approx([0.9, 118 / 120, 104 / 110])
    assert summary["goal_met"] is True
    slow = _streamed_results()["streamed"]
    for run in slow["runs"]:
        if run["path"] == "streamed":
            run["tokens_per_s"] *= 0.8
    assert summarize_streamed(slow)["goal_met"] is False


def test_the_streamed_table_shows_both_paths_the_ratio_and_what_ttft_means() -> None:
    table = render_streamed(_streamed_results())
    # plain: front end 0.1, 0.2, 0.3 cores x 2 s over 200, 240, 220 tokens: median 1.67 ms.
    assert "| plain | 110.0 | 700 / 880 | 1700 / 1880 | 1.67, 13.64 | 0 |" in table
    assert "| streamed | 104.0 | 20 / 29 | 1020 / 1029 | —, — | 0 |" in table
    assert "streamed / plain tokens/s: 0.945 (each round: 0.900, 0.983, 0.945)" in table
    assert "(streaming costs at most 10%): met" in table
    assert "plain, the whole answer" in table


def test_the_suites_markdown_holds_only_the_parts_that_ran() -> None:
    both = combined(render)
    alone = {**_streamed_results(), "runs": [], "ceiling": None}
    assert both(alone) == render_streamed(alone)  # --streamed: no systems' table


def test_the_command_line_chooses_the_streamed_path_alone() -> None:
    import argparse

    from bench.options import plan_from
    from bench.suites import generate

    parser = argparse.ArgumentParser()
    generate.add_parsers(parser.add_subparsers(dest="command"))
    argv = ["generate", "--streamed", "--stream-seconds", "5", "--stream-clients", "3"]
    plan = plan_from(GeneratePlan, parser.parse_args(argv))
    assert (plan.paths, plan.stream_s, plan.stream_clients) == (("streamed",), 5.0, 3)
    both = plan_from(GeneratePlan, parser.parse_args(["generate"]))
    assert both.paths == ("systems", "streamed")  # the default: both
    systems = plan_from(GeneratePlan, parser.parse_args(["generate", "--paths", "systems"]))
    assert systems.paths == ("systems",)
    with pytest.raises(ValueError, match="stream_clients must be >= 0, got -1"):
        GeneratePlan(stream_clients=-1)
    with pytest.raises(ValueError, match="unknown path 'chat'; of systems, streamed"):
        GeneratePlan(paths=("streamed", "chat"))


def test_the_streamed_path_answers_both_ways_on_a_real_server(
    bench_on_session_ray: SuiteRun,
) -> None:
    # Short phases: what is asserted is that both paths answer, not how fast.
    args = ["--streamed", "--blocks", "2", "--hidden", "32", "--rounds", "1", "--warmup", "0.5"]
    args += ["--stream-seconds", "1", "--stream-clients", "2", "--max-prompt", "24"]
    results = bench_on_session_ray.run("generate", *args, "--max-tokens", "8")
    assert results["runs"] == [] and results["ceiling"] is None  # no systems, no ceiling
    runs = {r["path"]: r for r in results["streamed"]["runs"]}
    assert sorted(runs) == ["plain", "streamed"]
    for run in runs.values():
        assert run["sent"] > 0 and run["errors"] == 0, run
        assert run["tokens"] > 0 and run["ttft_p50_s"] is not None
    table = bench_on_session_ray.table("generate")
    assert "| streamed |" in table and "| shardserve |" not in table
