"""Locust load of streamed generations: ``POST /v1/completions`` with ``"stream": true``.

    locust -f loadtest/generate.py --headless --host http://127.0.0.1:8000 -u 8 -r 8 -t 30s \\
        --model-name gpt2 --prompt "The quick brown fox" --max-tokens 64

Each user sends one streamed completion at a time (closed loop) and reads its events as they
come (``loadtest.sse``). Locust's table then shows, besides the request itself (its time to
the answer's headers, i.e. the server's first token, and its HTTP failures):

    STREAM /v1/completions               the whole stream: its time, its tokens as the length,
                                         a failure for an error event or a cut stream
    STREAM /v1/completions ttft          time to the first text, ms
    STREAM /v1/completions tpot          time per output token after the first, ms
    STREAM /v1/completions tokens_per_s  output tokens per second of the stream (the figure
                                         sits in the response-time columns: tokens/s, not ms)

``--prompt-ids 464,2068`` sends token ids instead of text (a model without a tokenizer cannot
answer the OpenAI routes: they answer text). ``--temperature`` 0 (greedy) by default.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from locust import FastHttpUser, events, task
from locust.env import Environment

from loadtest.sse import completion_body, measure_stream

PATH = "/v1/completions"
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
_state: dict[str, Any] = {"body": b""}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("shardserve streaming")
    group.add_argument("--model-name", default="", help="Served model; default: the server's.")
    group.add_argument("--prompt", default="The quick brown fox", help="The prompt's text.")
    group.add_argument("--prompt-ids", default="", help="Token ids instead, e.g. 464,2068.")
    group.add_argument("--max-tokens", type=int, default=64, help="Tokens per completion.")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    options: Any = environment.parsed_options
    ids = getattr(options, "prompt_ids", "")
    prompt: str | list[int] = (
        [int(i) for i in ids.split(",") if i.strip()] if ids else options.prompt
    )
    _state["body"] = completion_body(
        prompt,
        options.max_tokens,
        options.model_name or None,
        temperature=options.temperature,
    )


def _lines(response: Any) -> Iterator[bytes]:
    # geventhttpclient's response hands out a line as soon as it is whole; Locust's
    # iter_content reads fixed-size chunks, which would hold events back and skew the timings.
    raw = response._response
    while line := raw.readline(b"\n"):
        yield line


class StreamingUser(FastHttpUser):
    """One client streaming completions, one after another."""

    @task
    def complete(self) -> None:
        started = time.perf_counter()
        with self.client.post(
            PATH, data=_state["body"], headers=_HEADERS, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                return
            response.success()
            result = measure_stream(_lines(response), started, time.perf_counter)
        for report in result.reports(PATH):
            self.environment.events.request.fire(context={}, **report)
