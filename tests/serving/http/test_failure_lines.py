"""What a client sends goes into the log cut short, and a flood of failures is summarised: per
status, the first lines of each interval, then one line with the count of the rest (issue 37,
item 5: a 15 MB model name wrote a 15 MB line per call, one line per request at any rate)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from serving.http import replies
from serving.http.replies import log_failure
from serving.quoting import quote, quote_all
from tests.errorcheck import assert_clean_error
from tests.fakes import FakeRunner
from tests.serving.served_app import serve


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(replies, "time", SimpleNamespace(monotonic=fake.monotonic))
    return fake


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shardserve"]


def test_a_flood_of_400s_is_summarised_per_status_and_interval(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="shardserve"):
        for i in range(500):
            log_failure(f"r{i}", 400, "input 'x' holds strings")
        for i in range(3):
            log_failure(f"n{i}", 404, "model 'nope' not found")
        assert len(_lines(caplog)) == replies._LINES_PER_INTERVAL + 3  # 404s have their own
        clock.now += replies._INTERVAL_S
        log_failure("next", 400, "input 'x' holds strings")
    lines = _lines(caplog)
    summary = f"{500 - replies._LINES_PER_INTERVAL} more requests ended 400 in the last 10 s"
    assert [line for line in lines if "more requests" in line] == [
        summary + f" (each line past {replies._LINES_PER_INTERVAL} left out)"
    ]
    assert lines[-1] == "request next: 400 input 'x' holds strings"  # a new interval


def test_a_long_message_is_cut_in_its_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shardserve"):
        log_failure("r", 400, "x" * (1 << 20))
    (line,) = _lines(caplog)
    assert len(line) < 1100 and line.endswith("(1,048,576 characters)")


def test_quote_cuts_values_and_lists() -> None:
    assert quote("abc") == "'abc'"
    assert quote("m" * 100) == f"{'m' * 64!r}... (100 characters)"
    assert quote(10**5000).startswith("an integer of 16,610 bits")  # repr would raise
    assert quote_all(["b", "a"], sort=True) == "['a', 'b']"
    assert quote_all([str(i) for i in range(1000)]).endswith("'7', ... (992 more)]")


async def test_a_long_model_name_is_quoted_short_in_the_answer_and_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "m" * 50_000  # httpx takes URLs up to 64 KiB
    async with serve(FakeRunner(), batch_timeout_ms=0) as client:
        with caplog.at_level(logging.INFO, logger="shardserve"):
            r = await client.post(f"/v2/models/{name}/infer", json={"inputs": []})
            tf = await client.post(f"/v1/models/{name}:predict", json={"instances": [[1]]})
    for answer in (r, tf):
        assert answer.status_code == 404
        message = assert_clean_error(answer)
        assert message.startswith(f"model {'m' * 64!r}... (50,000 characters) not found")
        assert len(message) < 300
    assert max(len(line) for line in _lines(caplog)) < 1000
