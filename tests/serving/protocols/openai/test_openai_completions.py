"""The OpenAI-compatible API in process, over the fake generation replica (issue 40): the
completions answer's shape, its errors in OpenAI's shape, stop strings, streaming's framing, a
UTF-8 character split over two tokens, a stream past its deadline (the ``openai`` client raising
its error event), a client that hangs up mid-stream, the model list."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import orjson
import pytest

from serving.generation.tokenizer import ByteBPETokenizer
from serving.http.fast import ModelRef
from serving.protocols.openai.completions import v1_completions
from shards.generation.contract import RowResult, RowStep
from tests.fakes import WAIT_S
from tests.generation_fakes import END_ID, FakeGenerationReplica, expected_ids, make_info
from tests.generation_models import GPT2_MERGES, GPT2_VOCABULARY
from tests.metrics_text import metric
from tests.serving.protocols.v2.test_v2_generate import serve

URL = "/v1/completions"
# GPT-2's byte-level BPE writes byte 0xC3 as "Ã" and 0xA9 as "©": "é" is the two of them.
VOCABULARY = {**GPT2_VOCABULARY, "Ã": len(GPT2_VOCABULARY), "©": len(GPT2_VOCABULARY) + 1}
E_FIRST, E_SECOND = VOCABULARY["Ã"], VOCABULARY["©"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ByteBPETokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "vocabulary.json").write_text(json.dumps(VOCABULARY))
    (directory / "merges.txt").write_text("".join(f"{m}\n" for m in GPT2_MERGES))
    return ByteBPETokenizer(directory, start_token_id=END_ID)


def _info(**kwargs: Any) -> Any:
    return make_info(vocabulary_size=len(VOCABULARY), **kwargs)


class ScriptedReplica(FakeGenerationReplica):
    """The fake replica, its sampled ids taken from ``script`` (the i-th generated token is
    ``script[i]``) where one is given."""

    def __init__(self, script: Sequence[int] = (), **kwargs: Any) -> None:
        super().__init__(_info(**kwargs))
        self.script = list(script)

    async def step(self, rows: Sequence[RowStep]) -> list[RowResult]:
        results = await super().step(rows)
        if not self.script:
            return results
        return [
            RowResult(r.slot, self.script[row.token_index % len(self.script)], -0.25)
            for r, row in zip(results, rows, strict=True)
        ]


def _ids(text: str) -> list[int]:
    return [VOCABULARY[c] for c in text.replace(" ", "\u0120")]


async def test_a_text_prompt_completes_in_openais_shape(tokenizer: ByteBPETokenizer) -> None:
    fake = FakeGenerationReplica(_info())
    async with serve(fake, tokenizer) as client:
        body = {"model": "fake", "prompt": "the cat", "max_tokens": 4, "temperature": 0}
        answer = await client.post(URL, json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        prompt = tokenizer.encode("the cat")
        want = expected_ids(prompt, 4)
        assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
        assert isinstance(got["created"], int) and got["model"] == "fake"
        assert got["choices"] == [
            {
                "index": 0,
                "text": tokenizer.decode(want),
                "finish_reason": "length",
                "logprobs": None,
            }
        ]
        assert got["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": 4,
            "total_tokens": len(prompt) + 4,
        }


async def test_the_model_may_be_omitted_or_name_a_version(tokenizer: ByteBPETokenizer) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer) as client:
        for model in (None, "fake:1"):
            body = {"prompt": [3, 4], "max_tokens": 2, **({"model": model} if model else {})}
            answer = await client.post(URL, json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == tokenizer.decode(expected_ids([3, 4], 2))
            assert answer.json()["model"] == (model or "fake")


async def test_a_list_of_prompts_is_one_choice_each(tokenizer: ByteBPETokenizer) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer) as client:
        prompts = [[3, 4], "the", [7]]
        answer = await client.post(URL, json={"prompt": prompts, "max_tokens": 3, "logprobs": 1})
        assert answer.status_code == 200, answer.text
        choices = answer.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        for choice, prompt in zip(choices, prompts, strict=True):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            want = expected_ids(ids, 3)
            assert choice["text"] == tokenizer.decode(want)
            assert choice["logprobs"]["token_logprobs"] == [-0.5] * 3
            assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in want]
        assert answer.json()["usage"]["completion_tokens"] == 9


async def test_a_stop_string_spanning_tokens_is_cut_exactly(tokenizer: ByteBPETokenizer) -> None:
    # "ab cd ef": the stop string "b c" spans three tokens ("b", " ", "c").
    fake = ScriptedReplica(_ids("ab cd ef"))
    async with serve(fake, tokenizer) as client:
        body = {"prompt": [3], "max_tokens": 8, "stop": ["zz", "b c"]}
        answer = await client.post(URL, json=body)
        choice = answer.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("a", "stop")
        assert answer.json()["usage"]["completion_tokens"] == 4  # a, b, " ", c: then it ended
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.free_slots != 4:
            await asyncio.sleep(0.001)


async def _events(answer: Any) -> list[Any]:
    assert answer.headers["content-type"] == "text/event-stream"
    text = answer.text
    assert text.endswith("data: [DONE]\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e[6:]) for e in events[:-1]]


async def test_a_stream_sends_its_tokens_as_events_then_done(tokenizer: ByteBPETokenizer) -> None:
    fake = FakeGenerationReplica(_info())
    async with serve(fake, tokenizer) as client:
        body = {
            "prompt": [3, 4],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = await client.post(URL, json=body)
        assert answer.status_code == 200
        chunks = await _events(answer)
        *texts, last = chunks
        assert "".join(c["choices"][0]["text"] for c in texts) == tokenizer.decode(
            expected_ids([3, 4], 5)
        )
        assert all(c["object"] == "text_completion" for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in texts][-1] == "length"
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5


async def test_a_character_split_over_two_tokens_is_streamed_whole(
    tokenizer: ByteBPETokenizer,
) -> None:
    fake = ScriptedReplica([VOCABULARY["a"], E_FIRST, E_SECOND, VOCABULARY["b"]])
    async with serve(fake, tokenizer) as client:
        body = {"prompt": [3], "max_tokens": 4, "stream": True}
        chunks = await _events(await client.post(URL, json=body))
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == "aéb"
        assert "\ufffd" not in "".join(texts) and "é" in texts


async def test_a_stop_string_is_held_back_in_a_stream(tokenizer: ByteBPETokenizer) -> None:
    fake = ScriptedReplica(_ids("ab cd ef"))
    async with serve(fake, tokenizer) as client:
        body = {"prompt": [3], "max_tokens": 8, "stop": "b c", "stream": True}
        chunks = await _events(await client.post(URL, json=body))
        assert "".join(c["choices"][0]["text"] for c in chunks) == "a"
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_a_stream_that_fails_before_its_first_token_is_a_plain_error(
    tokenizer: ByteBPETokenizer,
) -> None:
    gate = asyncio.Event()
    fake = ScriptedReplica(kv_slots=1)
    async with serve(fake, tokenizer, kv_slots=1) as client:
        fake.gate = gate  # no step ends: the deadline passes before the first token
        body = {"prompt": [3], "max_tokens": 6, "stream": True}
        answer = await client.post(URL, json=body, headers={"X-Request-Timeout-Ms": "100"})
        assert answer.status_code == 504
        assert answer.json()["error"]["code"] == "deadline_exceeded"
        gate.set()


async def test_past_its_deadline_a_stream_ends_with_the_error_event(
    tokenizer: ByteBPETokenizer,
) -> None:
    fake = ScriptedReplica(kv_slots=1)
    async with serve(fake, tokenizer, generation_timeout_ms=1000, kv_slots=1) as client:
        gate = asyncio.Event()
        original = fake.step

        async def slow(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()  # the third token never comes: the deadline passes
            return await original(rows)

        fake.step = slow  # type: ignore[method-assign]
        body = {"prompt": [3], "max_tokens": 6, "stream": True}
        answer = await client.post(URL, json=body, headers={"X-Request-Timeout-Ms": "300"})
        chunks = await _events(answer)
        assert chunks[-1]["error"]["code"] == "deadline_exceeded"
        assert chunks[-1]["error"]["type"] == "timeout"
        gate.set()


async def test_the_openai_client_raises_a_streams_deadline_error_event(
    tokenizer: ByteBPETokenizer,
) -> None:
    import openai

    fake = ScriptedReplica(kv_slots=1)
    async with serve(fake, tokenizer, generation_timeout_ms=1000, kv_slots=1) as client:
        gate = asyncio.Event()
        original = fake.step

        async def slow(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()  # the third token never comes: the deadline passes
            return await original(rows)

        fake.step = slow  # type: ignore[method-assign]
        api = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=client, max_retries=0
        )
        stream = await api.completions.create(
            model="fake",
            prompt=[3],
            max_tokens=6,
            stream=True,
            extra_headers={"X-Request-Timeout-Ms": "300"},
        )
        texts = []
        with pytest.raises(openai.APIError) as failed:
            async for chunk in stream:
                texts.append(chunk.choices[0].text)
        assert failed.value.code == "deadline_exceeded"
        assert "".join(texts) == tokenizer.decode(expected_ids([3], 2))  # the two tokens out
        gate.set()


async def _running(client: Any) -> float:
    text = (await client.get("/metrics")).text
    return metric(text, "shardserve_running_sequences", model="fake", version="1")


async def test_a_client_that_hangs_up_mid_stream_frees_its_slot(
    tokenizer: ByteBPETokenizer,
) -> None:
    gate = asyncio.Event()
    fake = ScriptedReplica(kv_slots=1)
    async with serve(fake, tokenizer, kv_slots=1) as client:
        original = fake.step

        async def held(rows: Sequence[RowStep]) -> list[RowResult]:
            if rows[0].token_index >= 2:
                await gate.wait()
            return await original(rows)

        fake.step = held  # type: ignore[method-assign]
        body = orjson.dumps({"prompt": [1], "max_tokens": 20, "stream": True})
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []
        two_events = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if sum(m.get("body", b"").count(b"data: ") for m in sent) >= 2:
                two_events.set()

        scope = {
            "type": "http",
            "method": "POST",
            "path": URL,
            "query_string": b"",
            "headers": [(b"content-length", str(len(body)).encode())],
            "app": client.app,  # type: ignore[attr-defined]
        }
        call = asyncio.ensure_future(v1_completions(ModelRef(None), scope, receive, send))
        await asyncio.wait_for(two_events.wait(), WAIT_S)
        steps = fake.started
        gone.set()
        await asyncio.wait_for(call, WAIT_S)
        assert sent[0]["status"] == 200 and len([m for m in sent if "status" in m]) == 1
        assert await _running(client) == 1  # its step is still in flight
        gate.set()
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.free_slots != 1:
            await asyncio.sleep(0.001)
        # The step held in flight at the hang-up ends; none comes after it, and the gauge says
        # the slot is free.
        assert fake.started == steps + 1
        assert await _running(client) == 0
        assert not any(m.get("body", b"").endswith(b"[DONE]\n\n") for m in sent)


BAD = [
    ({"prompt": "a", "n": 2}, "n", "one choice per prompt"),
    ({"prompt": "a", "echo": True}, "echo", "does not implement echo"),
    ({"prompt": "a", "best_of": 3}, "best_of", "does not implement best_of"),
    ({"prompt": "a", "logprobs": 5}, "logprobs", "logprobs is 5"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer of at least 1"),
    ({"prompt": [1, 2], "max_tokens": 31}, "max_tokens", "max_tokens is 31"),
    ({"prompt": "a", "temperature": -1}, "temperature", "temperature is -1"),
    ({"prompt": "a", "top_p": 0}, "top_p", "top_p is 0"),
    ({"prompt": "a", "top_k": -2}, "top_k", "top_k must be"),
    ({"prompt": "a", "seed": "x"}, "seed", "seed must be"),
    ({"prompt": "a", "stop": [1]}, "stop", "stop must be a string"),
    (
        {"prompt": "a", "stream_options": {"include_usage": True}},
        "stream_options",
        "only allowed with stream",
    ),
    ({"prompt": [1, 500]}, "prompt", "prompt[1] is 500, outside the vocabulary"),
    ({"prompt": []}, "prompt", "prompt must be a string"),
    ({"prompt": ["a", 5]}, "prompt[1]", "prompt[1] must be a string"),
    ({"prompt": list(range(1, 33))}, "prompt", "prompt is 32 tokens"),
    ({}, "prompt", "prompt is missing"),
    ({"prompt": "a", "beams": 2}, "beams", "unknown field 'beams'"),
    ({"prompt": "a", "model": 5}, "model", "model must be a model's name"),
    ({"prompt": "a", "priority": "top"}, "priority", "priority is 'top'; the priority levels are"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD)
async def test_each_bad_field_is_a_400_in_openais_shape(
    tokenizer: ByteBPETokenizer, body: Any, param: str, message: str
) -> None:
    fake = FakeGenerationReplica(_info())
    async with serve(fake, tokenizer) as client:
        answer = await client.post(URL, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert message in error["message"], error
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert fake.started == 1  # the warm-up only


async def test_errors_keep_their_status_in_openais_shape(tokenizer: ByteBPETokenizer) -> None:
    async with serve(FakeGenerationReplica(_info()), tokenizer) as client:
        missing = await client.post(URL, json={"model": "nope", "prompt": "a"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        assert "nope" in missing.json()["error"]["message"]
        label = await client.post(URL, json={"model": "fake@canary", "prompt": "a"})
        assert label.status_code == 404
        not_json = await client.post(URL, content=b"{nope")
        assert not_json.status_code == 400
        assert "not JSON" in not_json.json()["error"]["message"]
        assert "Traceback" not in not_json.text


async def test_a_model_without_a_tokenizer_says_where_ids_generate() -> None:
    async with serve(FakeGenerationReplica()) as client:
        answer = await client.post(URL, json={"prompt": [1, 2]})
        assert answer.status_code == 400
        assert "/v2/models/{name}/generate" in answer.json()["error"]["message"]


async def test_the_model_list_holds_the_generating_models(tokenizer: ByteBPETokenizer) -> None:
    from tests.fakes import FakeRunner
    from tests.serving.served_app import serve as serve_runner

    async with serve(FakeGenerationReplica(_info()), tokenizer) as client:
        listed = (await client.get("/v1/models")).json()
        assert listed["object"] == "list"
        assert [(m["id"], m["object"]) for m in listed["data"]] == [("fake", "model")]
    async with serve_runner(FakeRunner()) as client:
        assert (await client.get("/v1/models")).json() == {"object": "list", "data": []}


async def test_v2_generate_stream_sends_the_generate_objects_as_events(
    tokenizer: ByteBPETokenizer,
) -> None:
    fake = ScriptedReplica([VOCABULARY["a"], E_FIRST, E_SECOND, VOCABULARY["b"]])
    async with serve(fake, tokenizer) as client:
        body = {"input_ids": [3], "parameters": {"max_tokens": 4}}
        answer = await client.post("/v2/models/fake/generate_stream", json=body)
        assert answer.headers["content-type"] == "text/event-stream"
        events = [json.loads(e[6:]) for e in answer.text.split("\n\n") if e]
        assert "".join(e["text_output"] for e in events) == "aéb"
        assert [t for e in events for t in e["output_ids"]] == [
            VOCABULARY["a"], E_FIRST, E_SECOND, VOCABULARY["b"]
        ]  # fmt: skip
        assert [e["finish_reason"] for e in events][-1] == "length"
        assert all(e["model_name"] == "fake" for e in events)
        refused = await client.post("/v2/models/fake/generate_stream", json={"input_ids": []})
        assert refused.status_code == 400 and "input_ids is empty" in refused.json()["error"]


async def test_a_client_that_stops_reading_is_cut_off_at_the_deadline(
    tokenizer: ByteBPETokenizer,
) -> None:
    async with serve(ScriptedReplica(kv_slots=1), tokenizer, kv_slots=1) as client:
        body = orjson.dumps({"prompt": [1], "max_tokens": 20, "stream": True})
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await never.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            if message.get("body"):  # the client reads nothing: its writes never drain
                await never.wait()
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": URL,
            "query_string": b"",
            "headers": [
                (b"content-length", str(len(body)).encode()),
                (b"x-request-timeout-ms", b"100"),
            ],
            "app": client.app,  # type: ignore[attr-defined]
        }
        call = v1_completions(ModelRef(None), scope, receive, send)
        await asyncio.wait_for(call, WAIT_S)  # returns: cut off, its connection then closed
        assert [m["type"] for m in sent] == ["http.response.start"]
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.free_slots != 1:
            await asyncio.sleep(0.001)


async def test_a_full_queue_of_the_default_model_leaves_the_openai_routes_to_the_app() -> None:
    from tests.serving.http.uvicorn_server import running

    async with running() as s:
        async with s.held():  # the default model's (a batching one's) queue is full
            seen = s.counting.http
            answer = await s.client.post(URL, json={"model": "fake", "prompt": "a"})
            assert s.counting.http == seen + 1  # the app answered, from the body's model
        assert answer.status_code == 404
        assert "does not generate text" in answer.json()["error"]["message"]
