"""The load generators' pure parts: hey's CSV split by status, the burst of clients in step,
Poisson arrivals, and the chaos traffic's verdict on an answer."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import orjson
import pytest
from aiohttp import web

from bench.load.chaos import judge
from bench.load.hey import parse_csv, summarize
from bench.load.pyload import _closed, arrivals, read_bodies, run

HEY_CSV = """response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,offset
0.0100,0.0001,0.0000,0.0000,0.0099,0.0000,200,0.5000
0.3000,0.0001,0.0000,0.0000,0.2999,0.0000,200,1.0000
0.0020,0.0001,0.0000,0.0000,0.0019,0.0000,503,1.2000
0.0040,0.0001,0.0000,0.0000,0.0039,0.0000,503,2.4960
"""


def test_hey_csv_is_split_by_status() -> None:
    result = parse_csv(HEY_CSV, clients=4, rate_per_client=2.0)
    assert result.count(200) == 2 and result.count(503) == 2
    assert result.seconds == pytest.approx(2.0)  # first start 0.5 s, last answer at 2.5 s
    assert result.per_s(200) == pytest.approx(1.0)
    assert result.per_s() == pytest.approx(2.0)
    assert result.statuses[200].max_ms == pytest.approx(300.0)
    assert result.p99_ms(503) == pytest.approx(3.98)
    assert result.p99_ms(500) is None


def test_burst_share_tells_clients_in_step_from_clients_spread_out() -> None:
    in_step = [(503, 0.001, 0.0, tick + 0.01) for tick in range(10) for _ in range(50)]
    spread = [(503, 0.001, 0.0, i / 50 + 0.001) for i in range(500)]
    assert summarize(in_step, clients=50, rate_per_client=1.0).burst_share == 1.0
    assert summarize(spread, clients=50, rate_per_client=1.0).burst_share == pytest.approx(0.1)
    assert summarize(spread, clients=50, rate_per_client=None).burst_share is None


def test_answers_are_judged_against_the_model() -> None:
    want = np.array([0.5, -1.0, 2.0], dtype=np.float32)
    ok = orjson.dumps({"predictions": [[0.5, -1.0, 2.0]]})
    off = orjson.dumps({"predictions": [[0.5, -1.0, 2.1]]})
    poison = b'{"error": "the model failed on this input: InvalidArgumentError: ..."}'
    assert judge(200, ok, False, want) == ("ok", "")
    assert judge(200, off, False, want)[0] == "wrong"
    assert judge(422, poison, False, want)[0] == "wrong"  # an innocent request blamed
    assert judge(503, b"{}", False, want)[0] == "lost"
    assert judge(0, b"", False, want) == ("lost", "no answer")
    assert judge(422, poison, True, want) == ("poison_422", "")
    assert judge(500, b"{}", True, want)[0] == "poison_wrong"


def test_poisson_arrivals_keep_the_mean_rate_and_vary_the_gaps() -> None:
    due = arrivals(200.0, 30.0, poisson=True)
    assert abs(len(due) / 30.0 - 200.0) < 10
    gaps = np.diff(due)
    assert (gaps >= 0).all() and 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential: cv 1
    assert np.array_equal(arrivals(10.0, 1.0, poisson=False), np.arange(10) / 10.0)


async def test_the_closed_loop_sends_several_bodies_in_turn(tmp_path: Path) -> None:
    received: list[bytes] = []

    async def predict(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.json_response({"predictions": [[0.0]]})

    app = web.Application()
    app.router.add_post("/predict", predict)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    try:
        bodies = [b'{"instances": [[1]]}', b'{"instances": [[1, 2]]}', b'{"instances": [[3]]}']
        result = await _closed(f"http://127.0.0.1:{port}/predict", bodies, 1, 0.2)
    finally:
        await runner.cleanup()
    assert result.errors == 0 and len(received) == result.requests >= 3
    assert received == [bodies[i % 3] for i in range(len(received))]
    body_file = tmp_path / "bodies.jsonl"
    body_file.write_bytes(b"\n".join(bodies) + b"\n\n")
    assert read_bodies(body_file) == bodies
    with pytest.raises(ValueError, match="one a line"):
        run("http://127.0.0.1:1/predict", [b'{"a":\n1}'], ["--concurrency", "1"], 1.0)
