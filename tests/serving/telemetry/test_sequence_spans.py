"""A generating request's spans in process (the fake generation replica, an in-memory exporter):
each sequence gets a ``sequence`` span under its request's, with its phases (queued, prefill,
decode and its step count) and why it ended: its length, a stop string, its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from serving.generation.tokenizer import ByteBPETokenizer
from shards.generation.contract import RowResult, RowStep
from tests.generation_fakes import FakeGenerationReplica
from tests.serving.protocols.openai.test_openai_completions import (
    ScriptedReplica,
    _ids,
    _info,
    tokenizer,
)
from tests.serving.protocols.v2.test_v2_generate import serve
from tests.serving.telemetry.test_tracing import exported

__all__ = ["exported", "tokenizer"]  # the fixtures, used by name

URL = "/v1/completions"


def _spans(exporter: InMemorySpanExporter, name: str) -> list[Any]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _children(exporter: InMemorySpanExporter, parent: Any) -> dict[str, Any]:
    return {
        s.name: s
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


async def test_each_sequence_has_a_span_under_its_request_with_its_phases(
    exported: InMemorySpanExporter, tokenizer: ByteBPETokenizer
) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer) as client:
        exported.clear()
        body = {"prompt": [[3, 4], [5]], "max_tokens": 3, "stream": True}
        answer = await client.post(URL, json=body, headers={"x-request-id": "r1"})
        assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
    (request,) = [s for s in exported.get_finished_spans() if s.name == "infer fake"]
    sequences = _spans(exported, "sequence")
    assert len(sequences) == 2
    for seq in sequences:
        assert seq.parent is not None and seq.parent.span_id == request.context.span_id
        assert seq.context.trace_id == request.context.trace_id
        assert seq.attributes["shardserve.finish_reason"] == "length"
        assert seq.attributes["shardserve.generated_tokens"] == 3
        assert seq.attributes["shardserve.decode_steps"] == 2  # the first token is prefill's
        assert seq.status.status_code is StatusCode.UNSET
        phases = _children(exported, seq)
        assert sorted(phases) == ["decode", "prefill", "queued"]
        assert phases["decode"].attributes["shardserve.steps"] == 2
        queued, prefill, decode = phases["queued"], phases["prefill"], phases["decode"]
        assert seq.start_time == queued.start_time <= queued.end_time <= prefill.start_time
        assert prefill.end_time <= decode.start_time <= decode.end_time <= seq.end_time
    assert sorted(s.attributes["shardserve.prompt_tokens"] for s in sequences) == [1, 2]


async def test_a_sequence_cut_by_a_stop_string_ended_for_stop(
    exported: InMemorySpanExporter, tokenizer: ByteBPETokenizer
) -> None:
    async with serve(ScriptedReplica(_ids("ab cd ef")), tokenizer) as client:
        exported.clear()
        body = {"prompt": [3], "max_tokens": 8, "stop": "b c", "stream": True}
        answer = await client.post(URL, json=body)
        assert answer.status_code == 200
    (seq,) = _spans(exported, "sequence")
    assert seq.attributes["shardserve.finish_reason"] == "stop"  # not "cancelled"
    assert seq.status.status_code is StatusCode.UNSET


async def test_a_sequence_past_its_deadline_has_an_error_status(
    exported: InMemorySpanExporter,
) -> None:
    fake = FakeGenerationReplica()
    async with serve(fake) as client:
        gate = asyncio.Event()
        original = fake.step

        async def slow(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()
            return await original(rows)

        fake.step = slow  # type: ignore[method-assign]
        exported.clear()
        body = {"input_ids": [1, 2], "parameters": {"max_tokens": 6}}
        answer = await client.post(
            "/v2/models/fake/generate", json=body, headers={"X-Request-Timeout-Ms": "200"}
        )
        assert answer.status_code == 504
        gate.set()
    (seq,) = _spans(exported, "sequence")
    assert seq.attributes["shardserve.finish_reason"] == "deadline"
    assert seq.attributes["shardserve.decode_steps"] == 1
    assert seq.status.status_code is StatusCode.ERROR
    assert _children(exported, seq)["decode"].attributes["shardserve.steps"] == 1
