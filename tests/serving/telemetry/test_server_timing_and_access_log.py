"""Every answer carries its ``Server-Timing`` (HTTP header, gRPC trailing metadata) and, with
``--access-log``, one structured line: on success and on the refusals (503 from the headers,
413, 400; gRPC: 503, 400), over HTTP through the real protocol and over gRPC, with the fake runner;
the routes outside the data plane (a 404, admin) get their line too, a probe or a scrape that
passes only with ``access_log_probes``."""

from __future__ import annotations

import asyncio
import io
import json
import re

import grpc
import numpy as np
import pytest

from serving.http.access import RouteLine
from serving.telemetry.access_log import FIELDS, AccessLog
from tests.fakes import FakeRunner, make_rows, spawn
from tests.serving.http.uvicorn_server import row, running
from tests.serving.protocols.v2.test_v2_grpc import infer_request, serve
from tests.serving.protocols.v2.test_v2_grpc_admission import refused

TIMING = re.compile(r"^queue;dur=[\d.]+, compute;dur=[\d.]+, total;dur=[\d.]+$")


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]


def _ms(timing: str, name: str) -> float:
    return float(re.search(rf"{name};dur=([\d.]+)", timing).group(1))  # type: ignore[union-attr]


async def test_http_answers_carry_server_timing_and_a_log_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with running(access_log="json") as s:
        ok = await s.client.post(
            "/predict", json={"instances": [row(1)]}, headers={"x-request-id": "ok-1"}
        )
        bad = await s.client.post("/predict", json={"instances": [[1.0]]})
        big = await s.client.post("/predict", content=b"x" * 5000)
        async with s.held():
            full = await s.client.post("/predict", json={"instances": [row(5)]})
    assert [ok.status_code, bad.status_code, big.status_code, full.status_code] == [
        200, 400, 413, 503,
    ]  # fmt: skip
    for answer in (ok, bad, big, full):
        assert TIMING.match(answer.headers["server-timing"]), answer.headers
    timing = ok.headers["server-timing"]
    assert _ms(timing, "total") >= _ms(timing, "compute") > 0
    lines = _lines(capsys)
    by_status = {line["status"]: line for line in lines}
    assert set(FIELDS) == set(lines[0])
    (first,) = [line for line in lines if line["request_id"] == "ok-1"]
    assert (first["request_id"], first["protocol"], first["route"], first["rows"]) == (
        "ok-1", "http", "/predict", 1,
    )  # fmt: skip
    assert first["model"] == "fake" and first["batch_rows"] == 1 and first["reject"] == ""
    assert first["bytes_out"] == len(ok.content) and first["bytes_in"] > 0
    assert str(first["client"]).startswith("127.0.0.1:")
    assert (by_status[400]["reject"], by_status[413]["reject"]) == ("invalid_input", "too_large")
    refusal = by_status[503]  # answered inside the protocol, from the headers
    assert (refusal["reject"], refusal["model"], refusal["rows"]) == ("queue_full", "fake", 0)
    assert "instances" not in capsys.readouterr().out  # never the body


async def test_grpc_answers_carry_server_timing_and_a_log_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A message over max_body_bytes is refused by gRPC itself (RESOURCE_EXHAUSTED) before any
    # handler: neither Server-Timing nor a log line can go with it (docs/observability.md, Access log).
    gate = asyncio.Event()
    gate.set()
    runner = FakeRunner(gate=gate)
    async with serve(
        runner, access_log="json", max_queue_rows=4, max_inflight_batches=1, batch_timeout_ms=0
    ) as s:
        call = s.stub.ModelInfer(infer_request(make_rows(2)["x"]))
        await call
        metadata = dict(await call.trailing_metadata())
        code_bad, bad = await refused(
            s.stub.ModelInfer(infer_request(np.zeros((1, 3), np.float32)))
        )
        gate.clear()
        batcher = s.state.model().require_batcher()
        first = await spawn(batcher.submit(make_rows(4)))  # in flight, held by the gate
        await runner.wait_started(3)
        second = await spawn(batcher.submit(make_rows(4, start=4)))  # fills the queue
        code_full, full = await refused(s.stub.ModelInfer(infer_request(make_rows(1)["x"])))
        gate.set()
        await asyncio.gather(first, second)
    assert TIMING.match(metadata["server-timing"])
    assert (code_bad, code_full) == (
        grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE,
    )  # fmt: skip
    assert TIMING.match(bad["server-timing"]), bad
    assert TIMING.match(full["server-timing"]), full
    lines = _lines(capsys)
    assert [(x["protocol"], x["route"], x["status"]) for x in lines] == [
        ("grpc", "ModelInfer", 200), ("grpc", "ModelInfer", 400), ("grpc", "ModelInfer", 503),
    ]  # fmt: skip
    assert lines[0]["rows"] == 2 and lines[0]["bytes_out"] > 0 and lines[0]["bytes_in"] > 0
    assert (lines[1]["reject"], lines[2]["reject"]) == ("invalid_input", "queue_full")


async def test_the_text_form_is_one_line_of_key_value_pairs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with running(access_log="text") as s:
        await s.client.post("/predict", json={"instances": [row(1)]}, headers={"x-request-id": "t"})
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("time=")]
    pairs = dict(part.split("=", 1) for part in line.split(" "))
    assert list(pairs) == list(FIELDS)
    assert (pairs["request_id"], pairs["status"], pairs["trace_id"]) == ("t", "200", "-")


async def test_a_text_line_cannot_be_forged_from_the_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """uvicorn percent-decodes the path: ``%0A`` is a newline, which the text form once wrote
    as is, so that a client wrote a second line of its own making (issue 37, item 6)."""
    async with running(access_log="text") as s:
        forged = "/no%0Atime=0%20status=200%20reject=%1b[2J%22%5C"
        missing = await s.client.get(forged, headers={"x-request-id": "f"})
    assert missing.status_code == 404
    out = capsys.readouterr().out.splitlines()
    (line,) = [x for x in out if "request_id=f " in x]
    assert [x for x in out if x.startswith("time=0")] == []
    assert ' route="/no\\ntime=0 status=200 reject=\\x1b[2J\\"\\\\" ' in line
    assert "\x1b" not in "\n".join(out)


def test_text_values_are_escaped_as_json_strings() -> None:
    stream = io.StringIO()
    log = AccessLog("text", stream)
    try:
        log.write(
            request_id="a\r\nb", trace_id=None, client="c", route="/p\u2028q", protocol="http",
            model="m\x85", version="1", status=200, rows=1, batch_rows=1, queue_ms=0.0,
            compute_ms=0.0, total_ms=0.0, bytes_in=0, bytes_out=0, reject="",
        )  # fmt: skip
    finally:
        log.close()
    (line,) = stream.getvalue().splitlines()
    assert 'request_id="a\\r\\nb" ' in line
    assert ' route="/p\\u2028q" ' in line and ' model="m\\x85" ' in line


async def test_no_log_line_with_the_access_log_off(capsys: pytest.CaptureFixture[str]) -> None:
    async with running() as s:
        ok = await s.client.post("/predict", json={"instances": [row(1)]})
    assert TIMING.match(ok.headers["server-timing"])
    assert "request_id" not in capsys.readouterr().out


async def test_routes_outside_the_data_plane_are_logged_but_a_passing_probe_is_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[str] = []  # with a user's middleware: the fast routes go through the stack
    for probes, middleware in ((False, None), (True, seen)):
        async with running(middleware, access_log="json", access_log_probes=probes) as s:
            for path in ("/healthz", "/readyz", "/metrics", "/v2/health/ready"):
                assert (await s.client.get(path)).status_code == 200
            missing = await s.client.get("/no/such/route", headers={"x-request-id": "gone"})
            admin = await s.client.get("/admin/batching")
            ok = await s.client.post("/predict", json={"instances": [row(1)]})
        assert (missing.status_code, ok.status_code) == (404, 200)
        lines = _lines(capsys)
        routes = [line["route"] for line in lines]
        probed = ["/healthz", "/readyz", "/metrics", "/v2/health/ready"] if probes else []
        assert routes == [*probed, "/no/such/route", "/admin/batching", "/predict"]  # once each
        by_route = {line["route"]: line for line in lines}
        gone = by_route["/no/such/route"]
        assert (gone["request_id"], gone["status"], gone["reject"]) == ("gone", 404, "not_found")
        assert gone["bytes_out"] == len(missing.content) and gone["model"] == ""
        assert by_route["/admin/batching"]["status"] == admin.status_code
        assert by_route["/predict"]["rows"] == 1  # the data plane's line, with its rows


async def test_a_failing_probe_is_always_logged() -> None:
    stream = io.StringIO()
    access = AccessLog("json", stream)
    try:
        for status in (200, 503):
            line = RouteLine({"path": "/readyz", "headers": [], "client": None}, _drop, access)
            await line.send({"type": "http.response.start", "status": status, "headers": []})
            await line.send({"type": "http.response.body", "body": b"{}"})
            line.write()
    finally:
        access.close()
    (written,) = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert (written["route"], written["status"], written["reject"]) == ("/readyz", 503, "not_ready")
    assert (written["bytes_out"], written["client"]) == (2, "-")


async def _drop(message: object) -> None:
    pass


def test_the_default_stream_is_the_stdout_of_each_line_not_of_the_logs_making(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process that swaps its stdout (a test runner's capture, a daemon's redirect) after the log
    # is made: the line goes to the stdout of its moment, not to a stream closed since.
    made_under = io.StringIO()
    monkeypatch.setattr("sys.stdout", made_under)
    access = AccessLog("json")
    made_under.close()
    now = io.StringIO()
    monkeypatch.setattr("sys.stdout", now)
    try:
        access.write(
            request_id="r-1", trace_id=None, client="127.0.0.1:1", route="/predict",
            protocol="http", model="m", version="1", status=200, rows=1, batch_rows=1,
            queue_ms=0.1, compute_ms=0.2, total_ms=0.4, bytes_in=10, bytes_out=20, reject="",
        )  # fmt: skip
    finally:
        access.close()
    (line,) = now.getvalue().splitlines()
    assert json.loads(line)["request_id"] == "r-1"
