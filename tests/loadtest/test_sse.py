"""The streaming Locust user's pure parts: server-sent events parsed from lines, and a
stream's figures (TTFT, time per output token, tokens/s, its error) from a scripted clock."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest

from loadtest.sse import SSEParser, StreamError, completion_body, measure_stream, stream_events


def _chunk(text: str, **extra: object) -> bytes:
    body = {"object": "text_completion", "choices": [{"index": 0, "text": text}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n"


def _lines(*events: bytes) -> list[bytes]:
    out = []
    for event in events:
        out += [event, b"\n"]
    return out


def _clock(*times: float) -> Callable[[], float]:
    ticks: Iterator[float] = iter(times)
    return lambda: next(ticks)


def test_events_end_at_a_blank_line_and_join_their_data_lines() -> None:
    lines = [
        b": a comment\n",
        b"event: message\r\n",
        b'data: {"a":\r\n',
        b"data:1}\r\n",
        b"\r\n",
        b"\n",  # a blank line with no event: nothing
        b"id: 7\n",
        b"data: [DONE]",  # its server closed without the blank line
    ]
    assert list(stream_events(lines)) == ['{"a":\n1}', "[DONE]"]


def test_a_parser_hands_out_nothing_before_the_blank_line() -> None:
    parser = SSEParser()
    assert parser.feed("data: x\n") is None
    assert parser.feed(b"data:  y\n") is None  # one space after the colon is the separator
    assert parser.feed("\n") == "x\n y"


def test_a_streams_figures_come_from_its_events_times() -> None:
    lines = _lines(
        _chunk("Hel"),
        _chunk(""),  # an event without text is no token
        _chunk("lo"),
        _chunk(" world", usage=None),
        b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n',
        b"data: [DONE]\n",
    )
    # started at 10.0; the events at 10.2, 10.25, 10.4, 10.6, 10.65, 10.7; the end at 10.8
    result = measure_stream(lines, 10.0, _clock(10.2, 10.25, 10.4, 10.6, 10.65, 10.7, 10.8))
    assert result.error is None and result.events == 6
    assert result.tokens == 5  # the usage's, not the three events with text
    assert result.ttft_ms == pytest.approx(200.0)
    assert result.tpot_ms == pytest.approx((10.6 - 10.2) * 1000 / 4)
    assert result.tokens_per_s == pytest.approx(5 / 0.8)
    reports = result.reports("/v1/completions")
    by_name = {r["name"]: r for r in reports}
    assert sorted(by_name) == [
        "/v1/completions",
        "/v1/completions tokens_per_s",
        "/v1/completions tpot",
        "/v1/completions ttft",
    ]
    assert by_name["/v1/completions"]["response_time"] == pytest.approx(800.0)
    assert by_name["/v1/completions"]["response_length"] == 5
    assert by_name["/v1/completions tokens_per_s"]["response_time"] == pytest.approx(6.25)
    assert all(r["exception"] is None and r["request_type"] == "STREAM" for r in reports)


def test_without_usage_each_event_with_text_is_a_token() -> None:
    lines = _lines(_chunk("a"), _chunk("b"), b"data: [DONE]\n")
    result = measure_stream(lines, 0.0, _clock(1.0, 3.0, 3.5, 4.0))
    assert result.tokens == 2 and result.tpot_ms == pytest.approx(2000.0)


def test_chat_deltas_and_v2_objects_carry_text_too() -> None:
    chat = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n'
    v2 = b'data: {"model_name": "m", "text_output": "hi", "output_ids": [5]}\n'
    assert measure_stream(_lines(chat, b"data: [DONE]\n"), 0.0, _clock(1, 2, 3)).tokens == 1
    result = measure_stream(_lines(v2, v2), 0.0, _clock(1, 2, 3), done=False)
    assert (result.tokens, result.error) == (2, None)  # generate_stream has no [DONE]


def test_an_error_event_fails_the_stream_and_reports_no_figures() -> None:
    error = b'data: {"error": {"message": "past its deadline", "code": "deadline_exceeded"}}\n'
    result = measure_stream(
        _lines(_chunk("a"), error, b"data: [DONE]\n"), 0.0, _clock(1.0, 2.0, 2.1, 2.2)
    )
    assert result.error == "error event: past its deadline"
    (whole,) = result.reports("/v1/completions")
    assert isinstance(whole["exception"], StreamError)
    assert "past its deadline" in str(whole["exception"])


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (_lines(_chunk("a")), "without data: [DONE]"),
        (_lines(b"data: {nope\n"), "not JSON"),
        (_lines(b"data: [1, 2]\n"), "not a JSON object"),
    ],
)
def test_a_cut_or_garbled_stream_is_an_error(lines: list[bytes], message: str) -> None:
    result = measure_stream(lines, 0.0, _clock(1.0, 2.0))
    assert result.error is not None and message in result.error


def test_the_body_asks_for_a_stream_with_its_usage() -> None:
    body = json.loads(completion_body([464, 2068], 16, "gpt2", temperature=0.0))
    assert body == {
        "prompt": [464, 2068],
        "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "model": "gpt2",
    }
    assert "model" not in json.loads(completion_body("hi", 4))
