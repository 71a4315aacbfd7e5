"""Locust load for a shardserve server: valid random inputs in the protocol of your choice.

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 16 -r 16 -t 30s

``--protocol tfserving`` (default) posts TF-Serving JSON to ``/predict``; ``v2-json`` posts Open
Inference Protocol JSON to ``/v2/models/{name}/infer``; ``v2-binary`` posts the same with the
binary tensor extension (raw little-endian bytes after a JSON header, answers in binary too).

Closed loop by default (each user sends its next request as soon as it has the answer). Open
loop with ``--target-rps R``: users pace themselves to R requests/s in total (use enough users
to keep R up while requests wait). ``--steps 4:10,16:10,64:10`` steps through user counts
(users:seconds). The model's signature comes from ``GET /v1/models/{name}/metadata`` once, at
test start; the bodies are encoded once, so Locust spends its CPU on sending, not on JSON.

``--warmup-s`` resets the statistics after a warm-up, and ``--summary-json PATH`` writes the
figures of the measured window at the end (the tuner reads it).
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import gevent
import numpy as np
from locust import FastHttpUser, LoadTestShape, events, task
from locust.env import Environment

from loadtest.bodies import PROTOCOLS, encode_body, make_bodies, random_inputs, request_path

_BODY_POOL = 32
__all__ = ["PROTOCOLS", "encode_body", "make_bodies", "random_inputs", "request_path"]
_state: dict[str, Any] = {"bodies": [], "window_start": None, "path": "/predict", "headers": {}}


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("shardserve")
    group.add_argument("--model-name", default="", help="Served model name; default: from /readyz.")
    group.add_argument("--rows", type=int, default=1, help="Rows per request.")
    group.add_argument(
        "--target-rps", type=float, default=0.0, help="Open loop: requests/s in total (0 = off)."
    )
    group.add_argument("--steps", default="", help="Stepped load, e.g. 4:10,16:10 (users:secs).")
    group.add_argument("--warmup-s", type=float, default=0.0, help="Reset stats after this long.")
    group.add_argument("--summary-json", default="", help="Write the measured figures here.")
    group.add_argument("--seed", type=int, default=0, help="Seed of the random inputs.")
    group.add_argument(
        "--protocol",
        default="tfserving",
        choices=PROTOCOLS,
        help="tfserving (/predict JSON), v2-json or v2-binary (/v2/models/{name}/infer).",
    )


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@events.test_start.add_listener
def _on_start(environment: Environment, **_: Any) -> None:
    options = environment.parsed_options
    host = (environment.host or "").rstrip("/")
    name = getattr(options, "model_name", "") or _get_json(f"{host}/readyz")["model"]
    metadata = _get_json(f"{host}/v1/models/{name}/metadata")
    rows = getattr(options, "rows", 1)
    protocol = getattr(options, "protocol", "tfserving")
    seed = getattr(options, "seed", 0)
    _state["bodies"] = make_bodies(metadata, rows, _BODY_POOL, seed, protocol)
    _state["path"] = request_path(protocol, name)
    one = random_inputs(metadata, rows, np.random.default_rng(seed))
    _state["headers"] = encode_body(one, protocol)[1]
    _state["window_start"] = time.time()
    warmup = getattr(options, "warmup_s", 0.0)
    if warmup > 0 and environment.runner is not None:
        gevent.spawn(_reset_after, environment, warmup)


def _reset_after(environment: Environment, seconds: float) -> None:
    gevent.sleep(seconds)
    assert environment.runner is not None
    environment.runner.stats.reset_all()
    _state["window_start"] = time.time()


def summary(environment: Environment) -> dict[str, Any]:
    """Figures of the measured window: successful requests/s and latency percentiles in ms."""
    assert environment.runner is not None
    total = environment.runner.stats.total
    elapsed = max(1e-9, time.time() - (_state["window_start"] or time.time()))
    ok = total.num_requests - total.num_failures
    rows = getattr(environment.parsed_options, "rows", 1)
    return {
        "requests": total.num_requests,
        "failures": total.num_failures,
        "seconds": elapsed,
        "rps": ok / elapsed,
        "rows_per_s": ok * rows / elapsed,
        "p50_ms": total.get_response_time_percentile(0.5) or 0.0,
        "p95_ms": total.get_response_time_percentile(0.95) or 0.0,
        "p99_ms": total.get_response_time_percentile(0.99) or 0.0,
    }


@events.test_stop.add_listener
def _on_stop(environment: Environment, **_: Any) -> None:
    path = getattr(environment.parsed_options, "summary_json", "")
    if path:
        with open(path, "w") as out:
            json.dump(summary(environment), out)


class PredictUser(FastHttpUser):
    """One client; closed loop, or paced to its share of ``--target-rps``."""

    _next_at = 0.0

    def wait_time(self) -> float:
        target = getattr(self.environment.parsed_options, "target_rps", 0.0)
        if not target:
            return 0.0
        users = max(1, self.environment.runner.user_count if self.environment.runner else 1)
        # Fixed pacing from the user's own schedule (not from the last answer), so that a slow
        # answer does not lower the offered rate as long as the user is free again in time.
        period = users / target
        now = time.monotonic()
        self._next_at = max(self._next_at + period, now)
        return self._next_at - now

    @task
    def predict(self) -> None:
        bodies = _state["bodies"]
        body = bodies[int(np.random.randint(len(bodies)))]
        path = _state["path"]
        # Binary bodies differ in nothing but the numbers: one header length fits them all.
        self.client.post(path, data=body, headers=_state["headers"], name=path)


class StepShape(LoadTestShape):
    """``--steps users:seconds,...`` in turn; without it, plain ``-u``/``-r``/``-t``."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        assert self.runner is not None
        options: Any = self.runner.environment.parsed_options
        steps = parse_steps(getattr(options, "steps", ""))
        elapsed = self.get_run_time()
        if not steps:
            limit = getattr(options, "run_time", None)
            if limit and elapsed >= limit:
                return None
            users = options.num_users or 1
            return users, float(options.spawn_rate or users)
        for users, seconds in steps:
            if elapsed < seconds:
                return users, float(users)
            elapsed -= seconds
        return None


def parse_steps(text: str) -> list[tuple[int, float]]:
    """``"4:10,16:10"`` -> ``[(4, 10.0), (16, 10.0)]``."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        users, sep, seconds = part.partition(":")
        try:
            step = (int(users), float(seconds))
        except ValueError:
            step = (0, 0.0)
        if not sep or step[0] < 1 or step[1] <= 0:
            raise ValueError(f"--steps wants users:seconds pairs like 4:10,16:10, got {part!r}")
        steps.append(step)
    return steps
