"""A real server's OpenTelemetry export, received by an OTLP/HTTP endpoint in this process
(``ExportTraceServiceRequest`` decoded with opentelemetry-proto): three clients' requests that
share one batch of the demo token model on real Ray actors give three request spans in the
clients' traces, one batch span linked to all three, stage spans from the actor processes under
it, and the poison row's span with an error status while its batch-mates' have none."""

from __future__ import annotations

import asyncio
import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.serverproc import Server, free_ports, running_server

POISON_ID = 1000  # out of demo-conv1d's Embedding(100): TensorFlow raises on it on CPU
CLIENT_TRACES = [f"{i:032x}" for i in (0xB1, 0xB2, 0xB3)]


class Collector:
    """The spans every export brought, with the pid of the process that sent them."""

    def __init__(self) -> None:
        self.spans: list[tuple[Any, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource_spans in request.resource_spans:
                resource = {
                    kv.key: kv.value.string_value or kv.value.int_value
                    for kv in resource_spans.resource.attributes
                }
                for scope in resource_spans.scope_spans:
                    self.spans.extend((span, resource) for span in scope.spans)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    found = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            found.take(self.rfile.read(int(self.headers["content-length"])))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    (port,) = free_ports(1)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield found, port
    finally:
        httpd.shutdown()


@pytest.fixture(scope="module")
def server(
    ray_address: str, collector: tuple[Collector, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("tracing")
    args = [
        "--model", "demo-conv1d", "--stages", "2", "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"), "--max-batch-size", "3",
        "--batch-timeout-ms", "3000", "--no-pad-lengths",
    ]  # fmt: skip
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector[1]}/v1/traces",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "shardserve-test",
    }
    with running_server(args, workdir, env=env) as srv:
        yield srv


async def _post(client: httpx.AsyncClient, url: str, i: int, ids: list[int]) -> httpx.Response:
    return await client.post(
        f"{url}/predict",
        json={"instances": [ids]},
        headers={"traceparent": f"00-{CLIENT_TRACES[i]}-{i + 1:016x}-01", "x-request-id": f"r{i}"},
    )


def _attrs(span: Any) -> dict[str, Any]:
    return {kv.key: kv.value.string_value or kv.value.int_value for kv in span.attributes}


def test_three_requests_one_batch_and_its_stages_reach_the_collector(
    server: Server, collector: tuple[Collector, int]
) -> None:
    found = collector[0]
    assert "tracing: on, exporting OTLP (http/protobuf)" in server.output()

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            rows = [[1, 2, 3, 4], [5, 6, 7, 8], [9, POISON_ID, 3, 4]]
            return await asyncio.gather(
                *(_post(client, server.url, i, r) for i, r in enumerate(rows))
            )

    answers = asyncio.run(three())
    assert [a.status_code for a in answers] == [200, 200, 422], [a.text for a in answers]
    for answer in answers:
        assert answer.headers["server-timing"].startswith("queue;dur=")

    def requests() -> dict[str, Any]:
        with found.lock:
            return {
                _attrs(s)["shardserve.request_id"]: s
                for s, _ in found.spans
                if s.name.startswith("infer ")
            }

    def stages() -> list[tuple[Any, dict[str, Any]]]:
        with found.lock:
            return [(s, r) for s, r in found.spans if s.name.startswith("stage ")]

    deadline = time.monotonic() + 30
    while (len(requests()) < 3 or len(stages()) < 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    by_id = requests()
    assert sorted(by_id) == ["r0", "r1", "r2"]
    for i, tid in enumerate(CLIENT_TRACES):
        assert by_id[f"r{i}"].trace_id.hex() == tid
    assert by_id["r2"].status.code == 2  # STATUS_CODE_ERROR
    assert str(POISON_ID) in by_id["r2"].status.message
    assert {by_id["r0"].status.code, by_id["r1"].status.code} == {0}
    with found.lock:
        batches = [s for s, _ in found.spans if s.name == "batch"]
        isolates = [s for s, _ in found.spans if s.name == "isolate"]
    (batch,) = [b for b in batches if len(b.links) == 3]
    assert {link.trace_id.hex() for link in batch.links} == set(CLIENT_TRACES)
    assert {link.span_id for link in batch.links} == {s.span_id for s in by_id.values()}
    # Stage spans come from the actors' own processes, under the batch (or its re-runs).
    under = {batch.span_id} | {s.span_id for s in isolates if s.trace_id == batch.trace_id}
    mine = [(s, r) for s, r in stages() if s.trace_id == batch.trace_id]
    assert mine and all(s.parent_span_id in under for s, _ in mine)
    assert any(s.parent_span_id == batch.span_id for s, _ in mine)
    pids = {r.get("process.pid") for _, r in mine}
    server_pid = {r.get("process.pid") for s, r in found.spans if s.name == "batch"}
    assert pids and not pids & server_pid
    failed = [s for s, _ in mine if s.status.code == 2]
    assert failed, "the stage that raised on the poison row marks its span failed"
