"""The summaries of a timeline's replies: spans, goodput, the 503 share, p99 windows with
failures as infinitely slow, when the p99 came back under a target, and which version answered."""

from __future__ import annotations

import math

import pytest

from bench.load.replies import (
    answers_after,
    back_under,
    by_version,
    failures,
    first_answer_s,
    p99_ms,
    p99_windows,
    summarize,
)
from bench.load.timeline import Reply


def reply(i: int, due: float, ms: float = 10.0, status: int = 200, version: str = "1") -> Reply:
    return Reply(i, due, ms, status, version if status == 200 else "", "" if status == 200 else "x")


def test_a_span_counts_statuses_goodput_and_the_503_share_of_the_requests_due_in_it() -> None:
    replies = [reply(i, i * 0.1) for i in range(20)]  # 0.0 .. 1.9 s
    replies[12] = reply(12, 1.2, status=503)
    replies[15] = reply(15, 1.5, status=0)
    got = summarize(replies, 1.0, 2.0)
    assert got["requests"] == 10 and got["ok"] == 8 and got["failed"] == 2
    assert got["statuses"] == {"0": 1, "200": 8, "503": 1}
    assert got["goodput_rps"] == pytest.approx(8.0) and got["offered_rps"] == pytest.approx(10.0)
    assert got["share_503"] == pytest.approx(0.1)
    assert got["latency_ms"]["n"] == 8
    assert summarize([], 0.0, 1.0)["share_503"] == 0.0


def test_a_failure_makes_a_window_p99_infinite_and_the_target_is_met_only_to_the_end() -> None:
    assert p99_ms([]) is None
    assert p99_ms([reply(0, 0.0, 5.0), reply(1, 0.1, status=503)]) == math.inf
    slow = [reply(i, i * 0.1, 500.0) for i in range(30)]  # 0 .. 3 s: slow
    fast = [reply(30 + i, 3.0 + i * 0.1, 20.0) for i in range(30)]  # 3 .. 6 s: fast
    blip = [reply(60, 4.05, 900.0)]
    windows = p99_windows(slow + fast, 0.0, 6.0, 1.0)
    assert [w[0] for w in windows] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert windows[0][1] == 500.0 and windows[5][1] == 20.0 and windows[5][2] == 10
    assert back_under(slow + fast, 0.0, 6.0, 100.0, 1.0) == 3.0
    assert back_under(slow + fast + blip, 0.0, 6.0, 100.0, 1.0) == 5.0  # a later slow window
    assert back_under(slow, 0.0, 3.0, 100.0, 1.0) is None


def test_versions_first_answer_answers_after_a_time_and_failures_sampled() -> None:
    replies = [
        reply(0, 0.0, version="1"),
        reply(1, 1.0, 50.0, version="2"),  # done at 1.05
        reply(2, 1.02, 5.0, version="1"),  # sent before v2's first answer came back
        reply(3, 1.1, version="1"),  # sent after: the traffic had moved
        reply(4, 1.2, status=503),
        reply(5, 1.3, status=503),
        reply(6, 1.4, status=503),
        reply(7, 1.5, status=503),
    ]
    first = first_answer_s(replies, "2")
    assert first is not None and first == pytest.approx(1.05)
    assert answers_after(replies, "1", first) == 1
    assert first_answer_s(replies, "3") is None
    assert set(by_version(replies)) == {"", "1", "2"} and by_version(replies)[""]["n"] == 4
    assert [f["index"] for f in failures(replies)] == [4, 5, 6]
