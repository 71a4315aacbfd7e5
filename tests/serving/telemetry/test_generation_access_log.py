"""A generation's access-log line (in process, the fake generation replica): one line at its
end, with its tokens, its time to first token and how it ended; a stream's failure after its
first token (status 200 sent already) says so in ``finish``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from serving.generation.tokenizer import ByteBPETokenizer
from serving.telemetry.access_log import FIELDS
from shards.generation.contract import RowResult, RowStep
from tests.generation_fakes import FakeGenerationReplica
from tests.serving.protocols.openai.test_openai_completions import _info, tokenizer
from tests.serving.protocols.v2.test_v2_generate import serve

__all__ = ["tokenizer"]  # the fixture, used by name


def _lines(capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, object]]:
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    by_id = {str(line["request_id"]): line for line in lines}
    assert len(by_id) == len(lines)  # one line per request
    return by_id


async def test_a_stream_and_a_plain_generation_log_their_tokens_and_ttft(
    capsys: pytest.CaptureFixture[str], tokenizer: ByteBPETokenizer
) -> None:
    fake = FakeGenerationReplica(_info(kv_slots=1))
    async with serve(fake, tokenizer, access_log="json", kv_slots=1) as client:
        capsys.readouterr()
        body = {"prompt": [[3, 4], [5]], "max_tokens": 3, "stream": True}
        streamed = await client.post("/v1/completions", json=body, headers={"x-request-id": "s"})
        assert streamed.text.endswith("data: [DONE]\n\n")
        plain = {"input_ids": [1, 2], "parameters": {"max_tokens": 4}}
        answer = await client.post(
            "/v2/models/fake/generate", json=plain, headers={"x-request-id": "p"}
        )
        assert answer.status_code == 200
        gate = asyncio.Event()
        original = fake.step

        async def slow(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()  # its third token never comes: the deadline passes
            return await original(rows)

        fake.step = slow  # type: ignore[method-assign]
        late = await client.post(
            "/v1/completions",
            json={"prompt": [3], "max_tokens": 6, "stream": True},
            headers={"x-request-id": "late", "x-request-timeout-ms": "200"},
        )
        assert "deadline_exceeded" in late.text
        gate.set()
        lines = _lines(capsys)
    assert set(lines["s"]) == set(FIELDS)
    stream, generated, cut = lines["s"], lines["p"], lines["late"]
    assert (stream["status"], stream["tokens"], stream["finish"]) == (200, 6, "length")
    assert (generated["status"], generated["tokens"], generated["finish"]) == (200, 4, "length")
    assert (cut["status"], cut["tokens"], cut["finish"]) == (200, 2, "deadline")
    for line in (stream, generated, cut):
        assert 0 < float(line["ttft_ms"]) <= float(line["total_ms"])  # type: ignore[arg-type]
    # A stream's line is written at its end: its total covers the wait for the deadline.
    assert float(cut["total_ms"]) >= 200  # type: ignore[arg-type]


async def test_a_generations_fields_end_a_text_line(
    capsys: pytest.CaptureFixture[str], tokenizer: ByteBPETokenizer
) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer, access_log="text") as client:
        capsys.readouterr()
        body = {"prompt": "the", "max_tokens": 8, "stop": "\n", "stream": True}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        out = [x for x in capsys.readouterr().out.splitlines() if "route=/v1/completions" in x]
    (line,) = out
    pairs = dict(pair.split("=", 1) for pair in line.split(" "))
    assert list(pairs)[-3:] == ["tokens", "ttft_ms", "finish"]
    assert int(pairs["tokens"]) > 0 and float(pairs["ttft_ms"]) > 0
    assert pairs["finish"] in ("length", "stop")


async def test_a_line_outside_generation_has_no_tokens(
    capsys: pytest.CaptureFixture[str], tokenizer: ByteBPETokenizer
) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer, access_log="json") as client:
        capsys.readouterr()
        refused = await client.post("/v1/completions", json={"prompt": "a", "n": 2})
        assert refused.status_code == 400
        (line,) = _lines(capsys).values()
    assert (line["tokens"], line["ttft_ms"], line["finish"]) == (0, 0.0, "")
    assert line["reject"] == "invalid_input"
