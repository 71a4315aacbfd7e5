"""Streams counted by how they ended (``shardserve_generation_streams_total{outcome}``), in
process over the fake generation replica: the finish reason its choices share (length, stop),
``done`` where they differ, a deadline, a failure after the first token, a hang-up
mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import pytest

from serving.errors import DeadlineExceededError, ModelInputError
from serving.generation.tokenizer import ByteBPETokenizer
from serving.http.fast import ModelRef
from serving.http.replies import ClientGone
from serving.metrics.series import STREAM_OUTCOMES
from serving.protocols.openai.completions import v1_completions
from serving.protocols.streaming import outcome
from shards.generation.contract import RowResult, RowStep
from tests.fakes import WAIT_S
from tests.generation_fakes import FakeGenerationReplica
from tests.metrics_text import metric
from tests.serving.protocols.openai.test_openai_completions import (
    VOCABULARY,
    ScriptedReplica,
    _ids,
    _info,
    tokenizer,
)
from tests.serving.protocols.v2.test_v2_generate import serve

__all__ = ["tokenizer"]  # the fixture, used by name

URL = "/v1/completions"
STREAMS = "shardserve_generation_streams_total"


async def _counts(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    return {o: metric(text, STREAMS, model="fake", version="1", outcome=o) for o in STREAM_OUTCOMES}


async def test_streams_are_counted_by_how_they_ended(tokenizer: ByteBPETokenizer) -> None:
    fake = ScriptedReplica(_ids("ab cd ef"))
    async with serve(fake, tokenizer) as client:
        assert await _counts(client) == dict.fromkeys(STREAM_OUTCOMES, 0.0)  # there from start
        plain = {"prompt": [3], "max_tokens": 3}
        assert (await client.post(URL, json=plain)).status_code == 200  # not a stream
        streamed = {**plain, "stream": True}
        for body in (streamed, streamed, {**streamed, "max_tokens": 8, "stop": "b c"}):
            assert (await client.post(URL, json=body)).status_code == 200
        # Two choices, one cut by its stop string and one at its length: "done".
        mixed = {"prompt": [[3], [4]], "max_tokens": 3, "stop": "b", "stream": True}
        fake.script = [VOCABULARY["a"], VOCABULARY["c"], VOCABULARY["d"]]
        original = fake.step

        async def second_row_says_b(rows: Sequence[RowStep]) -> list[RowResult]:
            results = await original(rows)
            return [
                RowResult(r.slot, VOCABULARY["b"], r.logprob) if row.token_ids[0] == 4 else r
                for r, row in zip(results, rows, strict=True)
            ]

        fake.step = second_row_says_b  # type: ignore[method-assign]
        assert (await client.post(URL, json=mixed)).status_code == 200
        fake.step = original  # type: ignore[method-assign]
        # A failure after the first token: the error event.
        fake.script = [VOCABULARY["a"], VOCABULARY["c"], VOCABULARY["d"]]
        fake.poison_id = VOCABULARY["c"]
        failed = await client.post(URL, json={**streamed, "max_tokens": 6})
        assert '"error"' in failed.text
        assert await _counts(client) == {
            "done": 1.0,
            "length": 2.0,
            "stop": 1.0,
            "cancelled": 0.0,
            "deadline": 0.0,
            "error": 1.0,
        }


async def test_a_stream_past_its_deadline_is_counted_as_deadline(
    tokenizer: ByteBPETokenizer,
) -> None:
    fake = FakeGenerationReplica(_info(kv_slots=1))
    async with serve(fake, tokenizer, kv_slots=1) as client:
        gate = asyncio.Event()
        original = fake.step

        async def slow(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()
            return await original(rows)

        fake.step = slow  # type: ignore[method-assign]
        body = {"prompt": [3], "max_tokens": 6, "stream": True}
        answer = await client.post(URL, json=body, headers={"X-Request-Timeout-Ms": "200"})
        assert "deadline_exceeded" in answer.text
        gate.set()
        counts = await _counts(client)
        assert counts["deadline"] == 1.0 and sum(counts.values()) == 1.0


@pytest.mark.parametrize(
    ("failure", "reasons", "want"),
    [
        (None, {"length"}, "length"),
        (None, {"stop"}, "stop"),
        (None, {"stop", "length"}, "done"),
        (DeadlineExceededError("late"), set(), "deadline"),
        (asyncio.CancelledError(), {"stop"}, "cancelled"),
        (ClientGone(), set(), "cancelled"),
        (ModelInputError("bad"), {"length"}, "error"),
        (RuntimeError("bug"), set(), "error"),
    ],
)
def test_a_streams_outcome(failure: BaseException | None, reasons: set[str], want: str) -> None:
    assert outcome(failure, reasons) == want
    assert want in STREAM_OUTCOMES


async def test_a_client_that_hangs_up_mid_stream_is_counted_as_cancelled(
    tokenizer: ByteBPETokenizer,
) -> None:
    fake = FakeGenerationReplica(_info(kv_slots=1))
    async with serve(fake, tokenizer, kv_slots=1) as client:
        gate = asyncio.Event()
        original = fake.step

        async def held(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 1:
                await gate.wait()  # after its first token, nothing more till the hang-up
            return await original(rows)

        fake.step = held  # type: ignore[method-assign]
        body = orjson.dumps({"prompt": [1], "max_tokens": 8, "stream": True})
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        gone, first = asyncio.Event(), asyncio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if b"data: " in message.get("body", b""):
                first.set()

        scope = {
            "type": "http",
            "method": "POST",
            "path": URL,
            "query_string": b"",
            "headers": [(b"content-length", str(len(body)).encode())],
            "app": client.app,  # type: ignore[attr-defined]
        }
        call = asyncio.ensure_future(v1_completions(ModelRef(None), scope, receive, send))
        await asyncio.wait_for(first.wait(), WAIT_S)
        gone.set()
        await asyncio.wait_for(call, WAIT_S)
        gate.set()
        counts = await _counts(client)
        assert counts["cancelled"] == 1.0 and sum(counts.values()) == 1.0
