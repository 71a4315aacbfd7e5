"""A streamed generation as a load test measures it (no Locust import here: the streaming user,
``loadtest/generate.py``, and the tests use it).

The stream's lines are read as they come (server-sent events: ``data:`` lines, an event ends at
a blank line); each event's arrival is timed, and the stream's figures come out at its end:

    ttft_ms          request sent -> its first event with text (or ids)
    tpot_ms          time per output token after the first: (last text - first text) / (tokens - 1)
    tokens_per_s     output tokens / (request sent -> the stream's end)
    error            what went wrong: an error event's message, a stream cut before its
                     ``[DONE]``, an event that is not JSON; ``None`` for a clean stream

The tokens are the last chunk's ``usage.completion_tokens`` (ask for it with
``stream_options.include_usage``); else the ``output_ids`` of V2's ``generate_stream`` events;
else one per event with text (an undercount where the server coalesced tokens for a slow
reader).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "SSEParser",
    "StreamResult",
    "completion_body",
    "measure_stream",
    "stream_events",
    "stream_summary",
]

DONE = "[DONE]"


class SSEParser:
    """Server-sent events from lines (``\\n`` or ``\\r\\n`` ended): ``feed`` returns an event's
    data (its ``data:`` lines joined by ``\\n``) at the blank line that ends it, else ``None``.
    Comments (``:``) and other fields (``event:``, ``id:``, ``retry:``) are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: bytes | str) -> str | None:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        text = text.rstrip("\r\n")
        if not text:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        field, _, value = text.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


def stream_events(lines: Iterable[bytes | str]) -> Iterator[str]:
    """Each event's data, as its blank line comes."""
    parser = SSEParser()
    for line in lines:
        data = parser.feed(line)
        if data is not None:
            yield data
    data = parser.feed("")  # a last event its server did not end with a blank line
    if data is not None:
        yield data


@dataclass(frozen=True)
class StreamResult:
    started: float
    ended: float
    first_text: float | None  # when the first event with text came
    last_text: float | None
    tokens: int
    events: int
    error: str | None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_text is None else (self.first_text - self.started) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        if self.first_text is None or self.last_text is None or self.tokens < 2:
            return None
        return (self.last_text - self.first_text) * 1000.0 / (self.tokens - 1)

    @property
    def tokens_per_s(self) -> float:
        seconds = self.ended - self.started
        return self.tokens / seconds if seconds > 0 else 0.0

    def reports(self, name: str) -> list[dict[str, Any]]:
        """The stream as Locust request events (``events.request.fire``'s arguments, less
        ``context``): the whole stream (its time, its tokens as the length, its error), then
        ``ttft``, ``tpot`` and ``tokens_per_s`` (a figure in the response-time column: tokens/s,
        not ms) where the stream gave them."""
        whole = {
            "request_type": "STREAM",
            "name": name,
            "response_time": (self.ended - self.started) * 1000.0,
            "response_length": self.tokens,
            "exception": None if self.error is None else StreamError(self.error),
        }
        out = [whole]
        if self.error is not None:
            return out
        figures = {"ttft": self.ttft_ms, "tpot": self.tpot_ms}
        if self.tokens:
            figures["tokens_per_s"] = self.tokens_per_s
        for what, value in figures.items():
            if value is not None:
                out.append(
                    {
                        "request_type": "STREAM",
                        "name": f"{name} {what}",
                        "response_time": value,
                        "response_length": 0,
                        "exception": None,
                    }
                )
        return out


class StreamError(Exception):
    """A stream that failed after its answer started (its status was 200)."""


def _text_of(chunk: dict[str, Any]) -> str:
    """A chunk's new text: completions' ``text``, chat's ``delta.content``, V2's
    ``text_output``."""
    if "text_output" in chunk:
        return str(chunk["text_output"] or "")
    text = ""
    for choice in chunk.get("choices") or ():
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def measure_stream(
    lines: Iterable[bytes | str], started: float, clock: Callable[[], float], done: bool = True
) -> StreamResult:
    """Read a stream to its end, timing its events with ``clock`` (``started``: when its request
    was sent, on the same clock). ``done``: it must end with ``data: [DONE]`` (OpenAI's) or, for
    V2's ``generate_stream``, an event with its ``finish_reason``."""
    first = last = None
    tokens = events = 0
    usage: int | None = None
    error: str | None = None
    finished = False
    for data in stream_events(lines):
        now = clock()
        events += 1
        if data == DONE:
            finished = True
            break
        try:
            chunk = json.loads(data)
        except ValueError:
            error = f"an event is not JSON: {data[:80]!r}"
            break
        if not isinstance(chunk, dict):
            error = f"an event is not a JSON object: {data[:80]!r}"
            break
        if "error" in chunk:
            failure = chunk["error"]
            message = failure.get("message") if isinstance(failure, dict) else failure
            error = f"error event: {str(message)[:200]}"
            continue  # its [DONE] follows
        ids = chunk.get("output_ids")
        if isinstance(ids, list) and ids:  # V2's stream: the ids themselves
            first = now if first is None else first
            last = now
            tokens += len(ids)
        elif _text_of(chunk):
            first = now if first is None else first
            last = now
            tokens += 1
        if "text_output" in chunk and chunk.get("finish_reason"):
            finished = True  # V2's generate_stream ends at its event with a finish_reason
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"].get("completion_tokens", usage)
    ended = clock()
    if error is None and done and not finished:
        error = "the stream ended without data: [DONE]"
    return StreamResult(
        started, ended, first, last, usage if usage is not None else tokens, events, error
    )


def completion_body(
    prompt: str | list[int], max_tokens: int, model: str | None = None, **extra: Any
) -> bytes:
    """A streamed ``/v1/completions`` body asking for its usage in the last chunk."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if model:
        body["model"] = model
    return json.dumps(body, separators=(",", ":")).encode()


def _percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; ``None`` for none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[rank]


def stream_summary(results: Sequence[StreamResult], seconds: float) -> dict[str, Any]:
    """A window's streams (``seconds`` long) in figures: streams and failures, output tokens/s
    (clean streams' tokens), TTFT and TPOT p50/p95 in ms (``None`` where no stream gave one)."""
    clean = [r for r in results if r.error is None]
    ttft = [r.ttft_ms for r in clean if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in clean if r.tpot_ms is not None]
    tokens = sum(r.tokens for r in clean)
    return {
        "streams": len(results),
        "failures": len(results) - len(clean),
        "seconds": seconds,
        "streams_per_s": len(clean) / seconds if seconds > 0 else 0.0,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "ttft_p50_ms": _percentile(ttft, 0.5),
        "ttft_p95_ms": _percentile(ttft, 0.95),
        "tpot_p50_ms": _percentile(tpot, 0.5),
        "tpot_p95_ms": _percentile(tpot, 0.95),
    }
