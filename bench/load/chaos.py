"""The chaos bench's traffic and its killer, in one event loop.

Requests start at a fixed rate whatever the server does (open loop; latency counts from when a
request was due). Every ``kill_every_s`` one live shard actor of the server is sent SIGKILL. The
victims are looked up among the server's own descendants (its private Ray's workers), never by
name alone: other servers' shard actors on the machine are not touched.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson
import psutil

POISON_MESSAGE = b"the model failed on this input"


@dataclass(frozen=True)
class Outcome:
    index: int
    poisoned: bool
    due_s: float  # since the start of the run
    latency_ms: float
    status: int  # 0: no answer (timeout, connection lost)
    verdict: str  # ok | wrong | lost | poison_422 | poison_wrong
    detail: str = ""


def judge(status: int, body: bytes, poisoned: bool, expected: np.ndarray) -> tuple[str, str]:
    """The verdict on one answer, and a short reason when it is not the wanted one."""
    if poisoned:
        if status == 422 and POISON_MESSAGE in body:
            return "poison_422", ""
        return "poison_wrong", f"{status}: {body[:200]!r}"
    if status == 200:
        try:
            got = np.asarray(orjson.loads(body)["predictions"][0], dtype=np.float32)
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
            return "wrong", f"200 with an unreadable body: {body[:200]!r}"
        if got.shape == expected.shape and np.allclose(got, expected, rtol=1e-4, atol=1e-5):
            return "ok", ""
        return "wrong", f"200 with {got.tolist()}, expected {expected.tolist()}"
    if status == 422:  # an innocent request blamed for a poisoned batch-mate
        return "wrong", f"422: {body[:200]!r}"
    return "lost", f"{status}: {body[:200]!r}" if status else "no answer"


def shard_actor_pids(server_pid: int) -> list[int]:
    """Live shard actor processes under ``server_pid`` (Ray titles them ``ray::ShardActor``)."""
    try:
        children = psutil.Process(server_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for child in children:
        try:
            cmdline = child.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if cmdline and cmdline[0].startswith("ray::ShardActor"):
            pids.append(child.pid)
    return sorted(pids)


async def healthy_replicas(session: aiohttp.ClientSession, status_url: str) -> int | None:
    try:
        async with session.get(status_url) as response:
            body = await response.json(loads=orjson.loads)
            return int(body["replicas"]["healthy"])
    except (aiohttp.ClientError, TimeoutError, KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Traffic:
    url: str
    status_url: str
    server_pid: int
    bodies: list[bytes]
    poisoned: np.ndarray  # bool per request
    expected: np.ndarray  # (n, outputs), NaN for poisoned rows
    rate: float
    kill_every_s: float
    seconds: float
    request_timeout_s: float
    seed: int


async def drive(traffic: Traffic) -> tuple[list[Outcome], list[dict[str, Any]]]:
    """Send every request at its time, kill on schedule; return outcomes and kills."""
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=traffic.request_timeout_s)
    headers = {"Content-Type": "application/json"}
    # Idle connections are closed here before uvicorn's keep-alive (5 s) closes them: a request
    # sent on a connection the server is closing gets no answer, and that race is the client's.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()

        async def fire(i: int, due: float) -> None:
            status, body = 0, b""
            try:
                async with session.post(traffic.url, data=traffic.bodies[i], headers=headers) as r:
                    status, body = r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                body = repr(exc).encode()
            latency_ms = (time.perf_counter() - due) * 1000.0
            poisoned = bool(traffic.poisoned[i])
            verdict, detail = judge(status, body, poisoned, traffic.expected[i])
            if status == 0:
                detail = f"no answer: {body[:200]!r}"
            outcomes.append(Outcome(i, poisoned, due - start, latency_ms, status, verdict, detail))

        killer = asyncio.create_task(_kill_on_schedule(session, traffic, start))
        tasks = []
        for i in range(len(traffic.bodies)):
            due = start + i / traffic.rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, due)))
        await asyncio.gather(*tasks)
        kills = await killer
    return sorted(outcomes, key=lambda o: o.index), kills


async def _kill_on_schedule(
    session: aiohttp.ClientSession, traffic: Traffic, start: float
) -> list[dict[str, Any]]:
    rng = np.random.default_rng(traffic.seed)
    kills: list[dict[str, Any]] = []
    k = 1
    while k * traffic.kill_every_s < traffic.seconds:
        await asyncio.sleep(max(0.0, start + k * traffic.kill_every_s - time.perf_counter()))
        healthy = await healthy_replicas(session, traffic.status_url)
        candidates = shard_actor_pids(traffic.server_pid)
        victim = int(rng.choice(candidates)) if candidates else None
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                victim = None
        kills.append(
            {
                "t_s": round(time.perf_counter() - start, 3),
                "pid": victim,
                "shard_actors": len(candidates),
                "healthy_replicas_before": healthy,
            }
        )
        k += 1
    return kills
