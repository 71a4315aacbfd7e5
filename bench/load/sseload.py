"""Closed-loop ``/v1/completions`` clients, streamed or plain (``python -m bench.load.sseload``),
one JSON line out.

``--clients`` clients each send their share of ``--bodies`` (client i bodies i, i + C, ...,
cycled) back to back, each request once the previous answered, until ``--seconds`` have passed
(a request begun before then is waited for). With ``--stream`` every body is sent with
``"stream": true`` and ``stream_options.include_usage``; without, as it is: the same requests
either way. Per answered request:

    first_s   streamed: request sent -> the first event with text (its TTFT, the client's
              clock: ``loadtest.sse.measure_stream``'s definition, the Locust user's);
              plain: request sent -> the whole answer (the first text a plain client sees)
    latency_s request sent -> the answer's end (the stream's ``[DONE]``)
    tokens    the answer's ``usage.completion_tokens`` (0 where the model's first token was its
              end token: such an answer has no ``first_s`` on either path)

and the time from the first request to the last answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import options
from bench.load.pyload import read_bodies
from bench.load.result import LoadError
from bench.systems.base import subprocess_env
from loadtest.sse import StreamResult, measure_stream

PATH = "/v1/completions"


@dataclass(frozen=True)
class SSELoad:
    stream: bool
    first_s: list[float]  # of the answered requests with a token, in order of their ends
    latencies_s: list[float]
    tokens: list[int]
    errors: int
    sent: int
    seconds: float  # first request to last answer
    failures: dict[str, int]  # why not: HTTP status, "error", or the stream's error -> count


Answer = tuple[float, str, float, float, int]  # (ended, "ok" or why not, first, whole, tokens)


def streamed(body: bytes) -> bytes:
    """``body`` asking for a stream that ends with its usage."""
    request = orjson.loads(body)
    request |= {"stream": True, "stream_options": {"include_usage": True}}
    return orjson.dumps(request)


def timed_stream(stamped: list[tuple[bytes, float]], started: float) -> StreamResult:
    """A stream's lines as they came (each with its arrival on the clock ``started`` is on),
    read by ``measure_stream``: each event timed at the line that ended it."""
    now = started

    def lines() -> Iterator[bytes]:
        nonlocal now
        for line, at in stamped:
            now = at
            yield line

    return measure_stream(lines(), started, lambda: now)


async def _plain(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[str, float, int]:
    """(``"ok"`` or why not, the answer's time, its tokens)."""
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        raw = await r.read()
        if r.status != 200:
            return str(r.status), 0.0, 0
        tokens = int(orjson.loads(raw)["usage"]["completion_tokens"])
    return "ok", time.perf_counter() - started, tokens


async def _stream(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[str, float, float, int]:
    """(``"ok"`` or why not, the first text's time, the end's, the tokens)."""
    started = time.perf_counter()
    stamped: list[tuple[bytes, float]] = []
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return str(r.status), 0.0, 0.0, 0
        async for line in r.content:
            stamped.append((line, time.perf_counter()))
    result = timed_stream(stamped, started)
    if result.error is not None:
        return result.error, 0.0, 0.0, 0
    # An answer whose first token was the end token has no text: no TTFT (``tally``).
    first = 0.0 if result.ttft_ms is None else result.ttft_ms / 1000.0
    return "ok", first, result.ended - started, result.tokens


async def _closed(
    base: str, bodies: list[bytes], clients: int, seconds: float, stream: bool
) -> SSELoad:
    url = base.rstrip("/") + PATH
    sent = [streamed(b) if stream else b for b in bodies]
    done: list[Answer] = []
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.perf_counter()
        until = start + seconds

        async def client(index: int) -> None:
            i = index
            while time.perf_counter() < until:
                body = sent[i % len(sent)]
                i += clients
                try:
                    if stream:
                        why, first, whole, tokens = await _stream(session, url, body)
                    else:
                        why, whole, tokens = await _plain(session, url, body)
                        first = whole
                except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
                    why, first, whole, tokens = "error", 0.0, 0.0, 0
                done.append((time.perf_counter(), why, first, whole, tokens))

        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
    return tally(done, stream, elapsed)


def tally(done: list[Answer], stream: bool, seconds: float) -> SSELoad:
    """The answers as the load reports them: in order of their ends; an answer with no token
    (the model's first was its end token) has no first text, on either path."""
    done = sorted(done)
    ok = [d for d in done if d[1] == "ok"]
    failures: dict[str, int] = {}
    for d in done:
        if d[1] != "ok":
            failures[d[1]] = failures.get(d[1], 0) + 1
    return SSELoad(
        stream=stream,
        first_s=[d[2] for d in ok if d[4]],
        latencies_s=[d[3] for d in ok],
        tokens=[d[4] for d in ok],
        errors=len(done) - len(ok),
        sent=len(done),
        seconds=seconds,
        failures=failures,
    )


def run(
    base: str,
    bodies: list[bytes],
    clients: int,
    seconds: float,
    stream: bool,
    workdir: Path,
) -> SSELoad:
    """The clients in a child process (its own interpreter: the driver's CPU stays apart)."""
    import subprocess

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "sseload-bodies.jsonl"
    path.write_bytes(b"\n".join(bodies))
    argv = [sys.executable, "-m", "bench.load.sseload", "--url", base, "--bodies", str(path)]
    argv += ["--clients", str(clients), "--seconds", f"{seconds:g}"]
    argv += ["--stream"] if stream else []
    proc = subprocess.run(argv, capture_output=True, env=subprocess_env())
    if proc.returncode != 0 or not proc.stdout.strip():
        raise LoadError(
            f"bench.load.sseload failed (exit {proc.returncode}): {proc.stderr[-800:]!r}"
        )
    fields: dict[str, Any] = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return SSELoad(**fields)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.sseload", description=__doc__)
    opts = options.Options(parser)
    opts.add("url", required=True, help="the server's base URL (the path is /v1/completions)")
    opts.own("--bodies", type=Path, required=True, help="file of JSON bodies, one a line")
    opts.add("clients", required=True)
    opts.add("seconds", required=True)
    opts.own("--stream", action="store_true", help='send each body with "stream": true')
    args = parser.parse_args()
    result = asyncio.run(
        _closed(args.url, read_bodies(args.bodies), args.clients, args.seconds, args.stream)
    )
    sys.stdout.write(orjson.dumps(asdict(result)).decode() + "\n")


if __name__ == "__main__":
    main()
