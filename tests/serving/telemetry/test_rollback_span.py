"""A canary's rollback is a short span of its own, ``canary.rollback``, with the version that
left, the stable that stays and the reason (the judge's verdict and the admin API's alike), and
the sampler records it whatever the ratio, as it does a batch span. Over the canary controller
on its own (``tests/serving/canary``) and an in-memory span exporter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, Decision

from serving.telemetry import active
from serving.telemetry.traces import Tracer
from shards import tracing
from tests.serving.canary.test_canary_controller import FAILED, OK, answer, rollout


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing._BatchAware(ALWAYS_OFF))  # a ratio of 0
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(active, "tracer", Tracer(provider))
    yield exporter


def test_the_judges_rollback_is_a_span_with_its_reason(exported: InMemorySpanExporter) -> None:
    r, clock, _, _ = rollout()
    answer(r, clock, "1", 50, OK, 0.01)
    answer(r, clock, "2", 20, FAILED, 0.01)
    assert r.state == "rolled_back"
    (span,) = exported.get_finished_spans()  # sampled at a ratio of 0 all the same
    assert span.name == "canary.rollback" and span.parent is None
    attributes = dict(span.attributes or {})
    assert attributes.pop("shardserve.rollback_detail").startswith("canary failure rate 1.00")
    assert attributes == {
        "shardserve.model": "m",
        "shardserve.version": "2",
        "shardserve.stable_version": "1",
        "shardserve.rollback_reason": "errors",
    }
    assert [e.name for e in span.events] == ["rollback"]


def test_an_admins_rollback_says_manual(exported: InMemorySpanExporter) -> None:
    r, _, _, _ = rollout()
    r.rollback("manual", "through the admin API")
    (span,) = exported.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["shardserve.rollback_reason"] == "manual"
    assert span.attributes["shardserve.rollback_detail"] == "through the admin API"


def test_the_sampler_keeps_a_rollback_and_leaves_the_rest_to_the_ratio() -> None:
    sampler = tracing._BatchAware(ALWAYS_OFF)
    kept = sampler.should_sample(None, 1, tracing.ROLLBACK)
    dropped = sampler.should_sample(None, 1, "infer m")
    assert (kept.decision, dropped.decision) == (Decision.RECORD_AND_SAMPLE, Decision.DROP)


def test_no_tracer_no_span_and_the_rollback_still_happens() -> None:
    assert active.tracer is None
    r, _, changes, _ = rollout()
    r.rollback("manual", "through the admin API")
    assert r.state == "rolled_back" and changes == ["m"]
