"""A small asyncio HTTP load generator (``python -m bench.load.pyload``), one JSON line out.

Closed loop (``--concurrency N``): N clients, each sends when its last answer came. Open loop
(``--rate R``): a request starts every 1/R s whatever the server does (``--poisson``: gaps
drawn from an exponential distribution of mean 1/R, seeded), and its latency counts from when it
was due, so a server that falls behind shows it in the tail; ``--skip S``: requests due in the
first S seconds are sent but not counted (a warm-up at the same rate). ``--bodies FILE`` (one
JSON body a line) instead of ``--body``: request i sends line i modulo their number, so a load of
mixed bodies (rows of different lengths) is the same sequence in every run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np

from bench import options
from bench.load.result import LoadResult, from_latencies, run_child

TOOL = "python"


def run(url: str, body: bytes | Sequence[bytes], how: list[str], seconds: float) -> LoadResult:
    """The generator in a child process, POSTing ``body`` (several: each in turn; ``how``:
    ``--concurrency N`` or ``--rate R`` and its options) for ``seconds``."""
    if isinstance(body, bytes):
        flag, content = "--body", body
    else:
        if any(b"\n" in one for one in body):
            raise ValueError("bodies sent in turn are one a line: serialize them without newlines")
        flag, content = "--bodies", b"\n".join(body)
    with tempfile.NamedTemporaryFile(prefix="bench-body-", suffix=".json") as body_file:
        body_file.write(content)
        body_file.flush()
        args = ["--url", url, flag, body_file.name, *how, "--seconds", f"{seconds:g}"]
        return run_child("bench.load.pyload", args)


def read_bodies(path: Path) -> list[bytes]:
    """The bodies of a ``--bodies`` file: one a line, blank lines skipped."""
    bodies = [line for line in path.read_bytes().splitlines() if line.strip()]
    if not bodies:
        raise ValueError(f"{path} holds no request body (one JSON body a line)")
    return bodies


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def _closed(url: str, bodies: list[bytes], concurrency: int, seconds: float) -> LoadResult:
    latencies: list[float] = []
    errors = 0
    sent = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        end = start + seconds

        async def client() -> None:
            nonlocal errors, sent
            while time.perf_counter() < end:
                body = bodies[sent % len(bodies)]
                sent += 1
                tick = time.perf_counter()
                ok = await _one(session, url, body)
                latencies.append(time.perf_counter() - tick)
                errors += not ok

        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return from_latencies("closed", concurrency, None, latencies, errors, elapsed, TOOL)


def arrivals(rate: float, seconds: float, poisson: bool, seed: int = 0) -> np.ndarray:
    """Offsets in seconds from the start at which requests are due, ``rate`` per second."""
    if not poisson:
        return np.arange(int(rate * seconds)) / rate
    gaps = np.random.default_rng(seed).exponential(1 / rate, int(rate * seconds * 1.5) + 16)
    due = np.cumsum(gaps) - gaps[0]
    return due[due < seconds]


async def _open(
    url: str,
    bodies: list[bytes],
    rate: float,
    seconds: float,
    poisson: bool = False,
    skip_s: float = 0.0,
) -> LoadResult:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        tasks = []

        async def fire(body: bytes, due: float, counted: bool) -> None:
            nonlocal errors
            ok = await _one(session, url, body)
            if counted:
                latencies.append(time.perf_counter() - due)
                errors += not ok

        for i, offset in enumerate(arrivals(rate, seconds + skip_s, poisson)):
            due = start + float(offset)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = bodies[i % len(bodies)]
            tasks.append(asyncio.create_task(fire(body, due, offset >= skip_s)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start - skip_s
    return from_latencies("open", 0, rate, latencies, errors, elapsed, TOOL)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.pyload", description=__doc__)
    opts = options.Options(parser)
    opts.add("url", required=True)
    opts.own("--body", help="file holding the JSON body to POST")
    opts.own("--bodies", type=Path, help="file of JSON bodies, one a line, sent in turn")
    opts.add("concurrency")
    opts.own("--rate", type=float, help="open loop: requests per second")
    opts.add("seconds", default=5.0)
    opts.own("--poisson", action="store_true", help="open loop: Poisson arrivals")
    opts.own("--skip", type=float, default=0.0, help="open loop: uncounted warm-up s")
    args = parser.parse_args()
    if (args.body is None) == (args.bodies is None):
        sys.exit("give exactly one of --body FILE or --bodies FILE (one body a line)")
    if (args.concurrency is None) == (args.rate is None):
        sys.exit("give exactly one of --concurrency N (closed loop) or --rate R (open loop)")
    bodies = [Path(args.body).read_bytes()] if args.bodies is None else read_bodies(args.bodies)
    if args.rate is not None:
        result = asyncio.run(
            _open(args.url, bodies, args.rate, args.seconds, args.poisson, args.skip)
        )
    else:
        result = asyncio.run(_closed(args.url, bodies, args.concurrency, args.seconds))
    result.print_line()


if __name__ == "__main__":
    main()
