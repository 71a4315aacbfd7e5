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
``--workload FILE`` draws the prompts and ``max_tokens`` from a distribution instead
(``loadtest.workload``: a TOML or JSON file), a pool of seeded bodies each user picks from.

``--warmup-s`` drops the streams that ended in the warm-up, and ``--summary-json PATH`` writes
the measured window's figures at the end (``stream_summary``: the generation tuner reads it).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, events, task
from locust.env import Environment

from loadtest.sse import StreamResult, completion_body, measure_stream, stream_summary
from loadtest.workload import load_workload

PATH = "/v1/completions"
_POOL = 64
_HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}
_state: dict[str, Any] = {
    "bodies": [b""],
    "path": PATH,
    "results": [],
    "window_start": 0.0,
}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("shardserve streaming")
    group.add_argument("--model-name", default="", help="Served model; default: the server's.")
    group.add_argument("--prompt", default="The quick brown fox", help="The prompt's text.")
    group.add_argument("--prompt-ids", default="", help="Token ids instead, e.g. 464,2068.")
    group.add_argument("--max-tokens", type=int, default=64, help="Tokens per completion.")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy.")
    group.add_argument("--workload", default="", help="A TOML/JSON distribution of prompts.")
    group.add_argument("--warmup-s", type=float, default=0.0, help="Streams not measured.")
    group.add_argument("--summary-json", default="", help="Write the measured figures here.")


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    options: Any = environment.parsed_options
    workload = getattr(options, "workload", "")
    if workload:
        drawn = load_workload(Path(workload))
        _state["bodies"] = drawn.bodies(_POOL, options.model_name)
        _state["path"] = drawn.path(options.model_name)
    else:
        ids = getattr(options, "prompt_ids", "")
        prompt: str | list[int] = (
            [int(i) for i in ids.split(",") if i.strip()] if ids else options.prompt
        )
        body = completion_body(
            prompt,
            options.max_tokens,
            options.model_name or None,
            temperature=options.temperature,
        )
        _state["bodies"], _state["path"] = [body], PATH
    _state["results"] = []
    _state["window_start"] = time.perf_counter()
    warmup = getattr(options, "warmup_s", 0.0)
    if warmup > 0:
        gevent.spawn(_reset_after, environment, warmup)


def _reset_after(environment: Environment, seconds: float) -> None:
    gevent.sleep(seconds)
    if environment.runner is not None:
        environment.runner.stats.reset_all()
    _state["results"] = []
    _state["window_start"] = time.perf_counter()


@events.test_stop.add_listener
def _on_stop(environment: Environment, **_: Any) -> None:
    path = getattr(environment.parsed_options, "summary_json", "")
    if path:
        seconds = time.perf_counter() - _state["window_start"]
        with open(path, "w") as out:
            json.dump(stream_summary(_state["results"], seconds), out)


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
        bodies = _state["bodies"]
        body = bodies[random.randrange(len(bodies))]
        path = _state["path"]
        started = time.perf_counter()
        with self.client.post(
            path, data=body, headers=_HEADERS, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"status {response.status_code}: {(response.text or '')[:200]}")
                _state["results"].append(_failed(started))
                return
            response.success()
            result = measure_stream(_lines(response), started, time.perf_counter)
        _state["results"].append(result)
        for report in result.reports(path):
            self.environment.events.request.fire(context={}, **report)


def _failed(started: float) -> StreamResult:
    now = time.perf_counter()
    return StreamResult(started, now, None, None, 0, 0, "refused")
