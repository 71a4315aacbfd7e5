"""An open-loop load that follows a rate schedule, with every request's outcome kept.

Requests start at their due time whatever the server does (latency counts from when a request
was due, so a server that falls behind shows it in the tail). The schedule is a list of steps
(rate, seconds); inside a step the requests are evenly spaced. Each reply keeps its due time,
latency, status and the version that answered (the KServe V2 infer answer's ``model_version``),
so a suite can say which version answered when. Actions (copy a version into a repository, say)
run in a thread at their time on the same clock, and when they ran is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass(frozen=True)
class Step:
    rate: float  # requests per second
    seconds: float

    def __post_init__(self) -> None:
        if self.rate < 0 or self.seconds <= 0:
            raise ValueError(f"a step needs rate >= 0 and seconds > 0, got {self}")


def due_times(steps: Sequence[Step]) -> list[float]:
    """When each request is due, in seconds from the start: evenly spaced inside each step."""
    out: list[float] = []
    start = 0.0
    for step in steps:
        n = round(step.rate * step.seconds)
        out += [start + i / step.rate for i in range(n)]
        start += step.seconds
    return out


def step_bounds(steps: Sequence[Step]) -> list[tuple[float, float]]:
    """Each step's [start, end) in seconds from the start."""
    bounds, start = [], 0.0
    for step in steps:
        bounds.append((start, start + step.seconds))
        start += step.seconds
    return bounds


@dataclass(frozen=True)
class Reply:
    index: int
    due_s: float  # since the start of the load
    latency_ms: float
    status: int  # 0: no answer (timeout, connection lost)
    version: str  # the answering version ("" when none said)
    detail: str = ""  # a short excerpt of a failed answer

    @property
    def done_s(self) -> float:
        return self.due_s + self.latency_ms / 1000.0

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(frozen=True)
class Action:
    at_s: float
    name: str
    run: Callable[[], object]


@dataclass
class Timeline:
    replies: list[Reply]
    actions: dict[str, float] = field(default_factory=dict)  # name -> when it finished, s


def answered_version(status: int, body: bytes) -> str:
    """The ``model_version`` of a V2 infer answer ("" when it has none)."""
    if status != 200:
        return ""
    try:
        return str(orjson.loads(body).get("model_version", ""))
    except (orjson.JSONDecodeError, AttributeError):
        return ""


async def drive(
    url: str,
    bodies: Sequence[bytes],
    steps: Sequence[Step],
    *,
    start: float,
    timeout_s: float = 60.0,
    actions: Sequence[Action] = (),
    until: Callable[[], bool] | None = None,
) -> Timeline:
    """POST ``bodies[i % len(bodies)]`` at each due time of ``steps``, counted from ``start``
    (a ``time.perf_counter()`` value, shared with a sampler); run ``actions`` at their time.
    ``until``: no request is started once it returns True (the steps are then a maximum)."""
    if not bodies:
        raise ValueError("drive needs at least one request body")
    timeline = Timeline([])
    headers = {"Content-Type": "application/json"}
    # Idle connections are closed here before uvicorn's keep-alive (5 s) closes them: a request
    # sent on a connection the server is closing gets no answer, and that race is the client's.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def fire(i: int, due: float) -> None:
            status, body, detail = 0, b"", ""
            try:
                async with session.post(url, data=bodies[i % len(bodies)], headers=headers) as r:
                    status, body = r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                detail = f"no answer: {exc!r}"[:200]
            latency_ms = (time.perf_counter() - due) * 1000.0
            if status not in (0, 200):
                detail = f"{status}: {body[:160]!r}"
            version = answered_version(status, body)
            timeline.replies.append(Reply(i, due - start, latency_ms, status, version, detail))

        async def act(action: Action) -> None:
            await asyncio.sleep(max(0.0, start + action.at_s - time.perf_counter()))
            await asyncio.to_thread(action.run)
            timeline.actions[action.name] = time.perf_counter() - start

        acting = [asyncio.create_task(act(a)) for a in actions]
        tasks = []
        for i, offset in enumerate(due_times(steps)):
            if until is not None and until():
                break
            due = start + offset
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, due)))
        await asyncio.gather(*tasks, *acting)
    timeline.replies.sort(key=lambda r: r.index)
    return timeline


def run(
    url: str,
    bodies: Sequence[bytes],
    steps: Sequence[Step],
    *,
    start: float | None = None,
    timeout_s: float = 60.0,
    actions: Sequence[Action] = (),
    until: Callable[[], bool] | None = None,
) -> Timeline:
    """``drive`` in an event loop of its own; ``start`` defaults to now."""
    begin = time.perf_counter() if start is None else start
    load = drive(url, bodies, steps, start=begin, timeout_s=timeout_s, actions=actions, until=until)
    return asyncio.run(load)
