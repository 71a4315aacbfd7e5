"""Open-loop generate requests (``python -m bench.load.genload``), one JSON line out.

Requests start at Poisson arrivals of mean ``--rate`` per second for ``--seconds`` (the
schedule seeded: ``pyload.arrivals``), whatever the server does; request i sends body i of
``--bodies`` (one JSON body a line, cycled). Each request's latency counts from when it was due,
so a server that falls behind shows it. Out: per request, its latency, the ids it got back and
whether it succeeded, and the time from the first arrival to the last answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import options
from bench.load.pyload import arrivals, read_bodies
from bench.load.result import LoadError
from bench.systems.base import subprocess_env


@dataclass(frozen=True)
class GenLoad:
    latencies_s: list[float]  # of the answered requests, in order of arrival
    tokens: list[int]  # the ids each answered request got back
    errors: int
    sent: int
    seconds: float  # first arrival to last answer
    statuses: dict[str, int]  # of the failed ones: HTTP status (or "error") -> count


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[str, int]:
    """(``"200"`` or why not, the ids the answer holds)."""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                return str(r.status), 0
            return "200", len(orjson.loads(raw).get("output_ids", ()))
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError):
        return "error", 0


async def _open(url: str, bodies: list[bytes], rate: float, seconds: float, seed: int) -> GenLoad:
    done: list[tuple[int, float, str, int]] = []
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:
        start = time.perf_counter()

        async def fire(i: int, body: bytes, due: float) -> None:
            status, tokens = await _one(session, url, body)
            done.append((i, time.perf_counter() - due, status, tokens))

        tasks = []
        for i, offset in enumerate(arrivals(rate, seconds, True, seed)):
            due = start + float(offset)
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(i, bodies[i % len(bodies)], due)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    done.sort()
    ok = [d for d in done if d[2] == "200"]
    statuses: dict[str, int] = {}
    for d in done:
        if d[2] != "200":
            statuses[d[2]] = statuses.get(d[2], 0) + 1
    return GenLoad(
        latencies_s=[d[1] for d in ok],
        tokens=[d[3] for d in ok],
        errors=len(done) - len(ok),
        sent=len(done),
        seconds=elapsed,
        statuses=statuses,
    )


def run(
    url: str, bodies: list[bytes], rate: float, seconds: float, seed: int, workdir: Path
) -> GenLoad:
    """The generator in a child process (its own interpreter: the driver's CPU stays apart)."""
    import subprocess

    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "genload-bodies.jsonl"
    path.write_bytes(b"\n".join(bodies))
    argv = [sys.executable, "-m", "bench.load.genload", "--url", url, "--bodies", str(path)]
    argv += ["--rate", f"{rate:g}", "--seconds", f"{seconds:g}", "--seed", str(seed)]
    proc = subprocess.run(argv, capture_output=True, env=subprocess_env())
    if proc.returncode != 0 or not proc.stdout.strip():
        raise LoadError(
            f"bench.load.genload failed (exit {proc.returncode}): {proc.stderr[-800:]!r}"
        )
    fields: dict[str, Any] = orjson.loads(proc.stdout.strip().splitlines()[-1])
    return GenLoad(**fields)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load.genload", description=__doc__)
    opts = options.Options(parser)
    opts.add("url", required=True)
    opts.own("--bodies", type=Path, required=True, help="file of JSON bodies, one a line")
    opts.own("--rate", type=float, required=True, help="mean requests per second")
    opts.add("seconds", required=True)
    opts.add("seed", default=0)
    args = parser.parse_args()
    result = asyncio.run(
        _open(args.url, read_bodies(args.bodies), args.rate, args.seconds, args.seed)
    )
    sys.stdout.write(orjson.dumps(asdict(result)).decode() + "\n")


if __name__ == "__main__":
    main()
