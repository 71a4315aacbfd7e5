"""Traces in process (the fake runner, an in-memory exporter): three clients' requests in one
batch give three request spans in the clients' traces and one batch span linked to all three;
a poison row's span has an error status and its batch-mates' not; the fast routes still serve
with a global tracer provider set; the latency histogram's exemplar is a sampled trace. With
tracing off, a request imports nothing of OpenTelemetry and makes no span."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serving.server.app import create_app
from serving.settings.config import Settings
from serving.telemetry import active
from serving.telemetry.traces import Tracer
from tests.fakes import FakeRunner

CLIENT_TRACES = [f"{i:032x}" for i in (0xA1, 0xA2, 0xA3)]


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(active, "tracer", Tracer(provider))
    # Anything may set a global provider (FastAPI turns its own telemetry on when one is):
    # the server's fast path must not care.
    saved = (trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE._done)
    trace.set_tracer_provider(provider)
    yield exporter
    trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE._done = saved


async def test_a_batch_span_links_its_requests_and_the_poison_row_fails_alone(
    exported: InMemorySpanExporter,
) -> None:
    runner = FakeRunner(poison=True)
    settings = Settings(model="fake", max_batch_size=3, batch_timeout_ms=2000)

    async def factory(_: Settings) -> FakeRunner:
        return runner

    app: Any = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.model().until_ready()
        exported.clear()
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        "/predict",
                        json={"instances": [[-1.0 if i == 2 else float(i), 0, 0, 0]]},
                        headers={
                            "traceparent": f"00-{tid}-{i + 1:016x}-01",
                            "x-request-id": f"r{i}",
                        },
                    )
                    for i, tid in enumerate(CLIENT_TRACES)
                )
            )
            metrics = await client.get(
                "/metrics", headers={"accept": "application/openmetrics-text"}
            )
        assert app.answers_fast_routes  # FastAPI's telemetry stayed off: the fast path served
    assert [a.status_code for a in answers] == [200, 200, 422]  # the model failed on it
    spans = exported.get_finished_spans()
    requests = {s.attributes["shardserve.request_id"]: s for s in spans if s.name == "infer fake"}
    assert sorted(requests) == ["r0", "r1", "r2"]
    for i, tid in enumerate(CLIENT_TRACES):
        span = requests[f"r{i}"]
        assert f"{span.context.trace_id:032x}" == tid
        assert span.parent is not None and span.parent.span_id == i + 1
    assert requests["r2"].status.status_code is StatusCode.ERROR
    assert "-1" in (requests["r2"].status.description or "")
    assert {requests[r].status.status_code for r in ("r0", "r1")} == {StatusCode.UNSET}
    (batch,) = [s for s in spans if s.name == "batch"]
    linked = {(link.context.trace_id, link.context.span_id) for link in batch.links}
    assert linked == {(s.context.trace_id, s.context.span_id) for s in requests.values()}
    assert batch.attributes["shardserve.rows"] == 3
    assert batch.attributes["shardserve.close_reason"] == "full"
    isolated = [s for s in spans if s.name == "isolate"]
    assert isolated and all(s.context.trace_id == batch.context.trace_id for s in isolated)
    queued = [s for s in spans if s.name == "queue"]
    assert len(queued) == 3 and all(s.parent is not None for s in queued)
    exemplars = [line for line in metrics.text.splitlines() if "trace_id=" in line]
    assert any(tid in line for line in exemplars for tid in CLIENT_TRACES[:2]), exemplars


def test_tracing_off_imports_no_opentelemetry_and_makes_no_span() -> None:
    # Its own process: what the rest of the suite imported says nothing of a request's path.
    script = textwrap.dedent(
        """
        import asyncio, sys
        import httpx
        from asgi_lifespan import LifespanManager
        from serving.server.app import create_app
        from serving.settings.config import Settings
        from tests.fakes import FakeRunner

        async def main():
            async def factory(_):
                return FakeRunner()
            app = create_app(Settings(model="fake", batch_timeout_ms=1), factory)
            async with LifespanManager(app) as manager:
                await app.state.shardserve.model().until_ready()
                before = {m for m in sys.modules if m.startswith("opentelemetry")}
                transport = httpx.ASGITransport(app=manager.app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    for i in range(20):
                        r = await c.post("/predict", json={"instances": [[i, 0, 0, 0]]},
                                         headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
                        assert r.status_code == 200, r.text
                after = {m for m in sys.modules if m.startswith("opentelemetry")}
                assert after == before, sorted(after - before)
                for name in ("serving.telemetry.traces", "opentelemetry.sdk", "opentelemetry.sdk.trace"):
                    assert name not in sys.modules, name
                assert app.answers_fast_routes
            print("OK")

        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.strip().endswith("OK"), done.stdout + done.stderr
