"""The generate route (KServe/Triton generate extension) in process, over the fake generation
replica: through the data plane, its 400s naming the field, a full queue, the deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from asgi_lifespan import LifespanManager

from serving.generation.engine import Generator
from serving.generation.scheduler import SchedulerSettings
from serving.generation.tokenizer import ByteBPETokenizer
from serving.http.fast import ModelRef
from serving.protocols.v2.generate import v2_generate
from serving.server.app import create_app
from serving.settings.config import Settings
from tests.errorcheck import assert_clean_error
from tests.fakes import WAIT_S, FakeRunner
from tests.generation_fakes import END_ID, FakeGenerationReplica, expected_ids, make_info
from tests.generation_models import GPT2_MERGES, GPT2_VOCABULARY
from tests.metrics_text import metric

URL = "/v2/models/fake/generate"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "vocabulary.json").write_text(json.dumps(GPT2_VOCABULARY))
    (directory / "merges.txt").write_text("".join(f"{m}\n" for m in GPT2_MERGES))
    return directory


@contextlib.asynccontextmanager
async def serve(
    replica: FakeGenerationReplica,
    tokenizer: ByteBPETokenizer | None = None,
    scheduler: SchedulerSettings | None = None,
    **overrides: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(model="fake", **overrides)

    async def factory(_: Settings) -> Generator:
        return Generator(
            [replica],
            scheduler or SchedulerSettings(groups=1, max_waiting=settings.max_waiting_prompts),
            tokenizer,
            load_tokenizer_from_info=False,
        )

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await asyncio.wait_for(app.state.shardserve.model().until_ready(), WAIT_S)
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            client.shardserve = app.state.shardserve  # type: ignore[attr-defined]
            client.app = app  # type: ignore[attr-defined]
            yield client


async def test_token_ids_in_the_completion_out() -> None:
    fake = FakeGenerationReplica()
    async with serve(fake) as client:
        for url in (URL, "/v2/models/fake/versions/1/generate"):
            answer = await client.post(
                url, json={"input_ids": [3, 4, 5], "parameters": {"max_tokens": 5}}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json() == {
                "model_name": "fake",
                "model_version": "1",
                "output_ids": expected_ids([3, 4, 5], 5),
                "finish_reason": "length",
            }


async def test_text_in_text_out_with_the_start_token(tokenizer_dir: Path) -> None:
    fake = FakeGenerationReplica(make_info(vocabulary_size=len(GPT2_VOCABULARY)))
    tokenizer = ByteBPETokenizer(tokenizer_dir, start_token_id=END_ID)
    async with serve(fake, tokenizer) as client:
        answer = await client.post(
            URL, json={"text_input": "the cat", "parameters": {"max_tokens": 4}}
        )
        assert answer.status_code == 200, answer.text
        prompt = tokenizer.encode("the cat")
        assert prompt[0] == END_ID
        want = expected_ids(prompt, 4)
        assert answer.json()["output_ids"] == want
        assert answer.json()["text_output"] == tokenizer.decode(want)
        # The prompt the replica saw: the start token, then the text's ids.
        assert list(fake.steps[-4][0].token_ids) == prompt


async def test_a_stop_id_ends_the_completion() -> None:
    fake = FakeGenerationReplica()
    want = expected_ids([9], 6)
    async with serve(fake) as client:
        body = {"input_ids": [9], "parameters": {"max_tokens": 6, "stop_token_ids": [want[3]]}}
        answer = (await client.post(URL, json=body)).json()
        cut = want.index(want[3])
        assert (answer["output_ids"], answer["finish_reason"]) == (want[:cut], "stop")


BAD = [
    ({"input_ids": list(range(1, 33))}, "the prompt is 32 tokens"),
    ({"input_ids": [1, 2], "parameters": {"max_tokens": 31}}, "parameters.max_tokens is 31"),
    ({"input_ids": [1, 50]}, "input_ids[1] is 50, outside the vocabulary"),
    ({"input_ids": [1, "a"]}, "input_ids[1] must be an integer"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1], "parameters": {"temperature": -0.5}}, "parameters.temperature is -0.5"),
    ({"input_ids": [1], "parameters": {"top_p": 0}}, "parameters.top_p is 0"),
    ({"input_ids": [1], "parameters": {"top_k": -1}}, "parameters.top_k must be"),
    ({"input_ids": [1], "parameters": {"seed": "x"}}, "parameters.seed must be"),
    ({"input_ids": [1], "parameters": {"stop_token_ids": [99]}}, "stop_token_ids[0] is 99"),
    ({"input_ids": [1], "parameters": {"beams": 2}}, "unknown parameter 'beams'"),
    ({"input_ids": [1], "text_input": "a"}, "exactly one of text_input and input_ids"),
    ({"parameters": {}}, "exactly one of text_input and input_ids"),
    ({"text_input": "hello"}, "text_input: this model has no tokenizer"),
    ([1, 2], "must be a JSON object"),
]


@pytest.mark.parametrize(("body", "message"), BAD)
async def test_bad_input_is_a_400_naming_the_field(body: Any, message: str) -> None:
    fake = FakeGenerationReplica()
    async with serve(fake) as client:
        answer = await client.post(URL, json=body)
        assert answer.status_code == 400
        assert message in answer.json()["error"]
        assert_clean_error(answer)
        assert fake.started == 1  # the warm-up only


class CountingTokenizer(ByteBPETokenizer):
    calls = 0

    def encode(self, text: str) -> list[int]:
        CountingTokenizer.calls += 1
        return super().encode(text)


async def test_a_text_too_long_for_a_slot_is_refused_before_tokenizing(
    tokenizer_dir: Path,
) -> None:
    fake = FakeGenerationReplica(make_info(vocabulary_size=len(GPT2_VOCABULARY)))
    tokenizer = CountingTokenizer(tokenizer_dir)
    async with serve(fake, tokenizer) as client:
        limit = 32 * tokenizer.max_token_bytes
        answer = await client.post(URL, json={"text_input": "a" * (limit + 1)})
        assert answer.status_code == 400
        assert f"text_input is {limit + 1} bytes" in answer.json()["error"]
        assert CountingTokenizer.calls == 0
        # Within the bytes but over the slot once tokenized: refused by its token count.
        answer = await client.post(URL, json={"text_input": "a" * 40})
        assert answer.status_code == 400
        assert "the prompt is 40 tokens" in answer.json()["error"]


async def test_a_full_prompt_queue_is_a_503_with_retry_after() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1))
    async with serve(fake, max_waiting_prompts=1, kv_slots=1) as client:
        fake.gate = gate
        body = {"input_ids": [1], "parameters": {"max_tokens": 2}}
        running = asyncio.ensure_future(client.post(URL, json=body))
        await fake.wait_started(2)
        queued = asyncio.ensure_future(client.post(URL, json=body))
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.waiting < 1:
            await asyncio.sleep(0.001)
        refused = await client.post(URL, json=body)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "max_waiting_prompts=1" in refused.json()["error"]
        gate.set()
        assert [(await r).status_code for r in (running, queued)] == [200, 200]


async def test_past_generation_timeout_ms_is_a_504_and_the_slot_is_freed() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1))
    async with serve(fake, generation_timeout_ms=50, kv_slots=1) as client:
        fake.gate = gate
        answer = await client.post(URL, json={"input_ids": [1], "parameters": {"max_tokens": 4}})
        assert answer.status_code == 504
        assert "generation_timeout_ms" in answer.json()["error"]
        gate.set()
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.free_slots != 1:
            await asyncio.sleep(0.001)


async def test_predict_on_a_generating_model_says_where_to_generate() -> None:
    async with serve(FakeGenerationReplica()) as client:
        answer = await client.post("/v2/models/fake/infer", json={"inputs": []})
        assert answer.status_code == 400
        assert "POST /v2/models/fake/generate" in answer.json()["error"]


async def test_generate_on_a_model_that_does_not_generate_is_a_404() -> None:
    from tests.serving.served_app import serve as serve_runner

    async with serve_runner(FakeRunner()) as client:
        answer = await client.post(URL, json={"input_ids": [1]})
        assert answer.status_code == 404
        assert "does not generate text" in answer.json()["error"]


async def test_the_metrics_count_steps_tokens_and_slots() -> None:
    async with serve(FakeGenerationReplica()) as client:
        body = {"input_ids": [1, 2], "parameters": {"max_tokens": 3}}
        assert (await client.post(URL, json=body)).status_code == 200
        text = (await client.get("/metrics")).text
        labels = {"model": "fake", "version": "1"}
        steps = "shardserve_generation_steps_total"
        # The warm-up's one token, then this request's three.
        assert metric(text, "shardserve_generated_tokens_total", **labels) == 4
        assert metric(text, steps, **labels, kind="prefill") == 2
        assert metric(text, steps, **labels, kind="decode") == 2
        assert metric(text, "shardserve_time_to_first_token_seconds_count", **labels) == 2
        assert metric(text, "shardserve_time_per_output_token_seconds_count", **labels) == 2
        assert metric(text, "shardserve_generation_step_rows_count", **labels) == 4
        assert metric(text, "shardserve_running_sequences", **labels) == 0
        assert metric(text, "shardserve_free_kv_slots", **labels) == 4


async def test_a_client_that_hangs_up_frees_its_slot_within_one_step() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=1))
    async with serve(fake, kv_slots=1) as client:
        fake.gate = gate
        body = orjson.dumps({"input_ids": [1], "parameters": {"max_tokens": 20}})
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": URL,
            "query_string": b"",
            "headers": [(b"content-length", str(len(body)).encode())],
            "app": client.app,  # type: ignore[attr-defined]
        }
        call = asyncio.ensure_future(v2_generate(ModelRef("fake"), scope, receive, send))
        await fake.wait_started(2)  # the warm-up's step, then this prompt's prefill
        gone.set()
        await asyncio.wait_for(call, WAIT_S)
        assert sent[0]["status"] == 499
        gate.set()
        scheduler = client.shardserve.model().generator.scheduler  # type: ignore[attr-defined]
        while scheduler.free_slots != 1:
            await asyncio.sleep(0.001)
        assert fake.started == 2  # no step after the one in flight at the hang-up
        # The slot serves the next prompt.
        answer = await client.post(URL, json={"input_ids": [4], "parameters": {"max_tokens": 2}})
        assert answer.json()["output_ids"] == expected_ids([4], 2)


async def test_a_retired_generating_version_answers_what_it_admitted_then_closes() -> None:
    gate = asyncio.Event()
    fake = FakeGenerationReplica(make_info(kv_slots=2))
    async with serve(fake) as client:
        fake.gate = gate
        body = {"input_ids": [3], "parameters": {"max_tokens": 3}}
        running = asyncio.ensure_future(client.post(URL, json=body))
        await fake.wait_started(2)
        model = client.shardserve.model()  # type: ignore[attr-defined]
        retire = asyncio.ensure_future(model.retire("version 2 replaces it"))
        while model.state != "DRAINING":
            await asyncio.sleep(0.001)
        refused = await client.post(URL, json=body)
        assert refused.status_code == 503
        assert "version 2 replaces it" in refused.json()["error"]
        assert not fake.closed
        gate.set()
        answer = await running
        assert answer.json()["output_ids"] == expected_ids([3], 3)
        await asyncio.wait_for(retire, WAIT_S)
        assert fake.closed and model.state == "RETIRED"


async def test_a_generating_version_is_ready_and_its_metadata_shows_ids_in_and_out() -> None:
    async with serve(FakeGenerationReplica()) as client:
        assert (await client.get("/v2/models/fake/ready")).status_code == 200
        assert (await client.get("/readyz")).status_code == 200
        metadata = await client.get("/v2/models/fake")
        assert metadata.status_code == 200, metadata.text
        assert [t["name"] for t in metadata.json()["inputs"]] == ["input_ids"]
        assert [t["name"] for t in metadata.json()["outputs"]] == ["output_ids"]


async def test_the_admin_route_changes_max_running_sequences_at_run_time() -> None:
    token = "a-long-enough-admin-token-for-tests"
    fake = FakeGenerationReplica(make_info(kv_slots=4))
    async with serve(fake, admin_token=token) as client:
        auth = {"Authorization": f"Bearer {token}"}
        url = "/admin/models/fake/generation"
        view = await client.get(url, headers=auth)
        assert view.status_code == 200, view.text
        assert view.json() == {
            "kv_slots": 4,
            "max_running_sequences": 4,
            "prefill_timeout_ms": "auto",
            "prefill_budget_tokens": None,
            "replicas": 1,
            "running_sequences": 0,
            "waiting_prompts": 0,
            "free_kv_slots": 4,
        }
        changed = await client.put(url, headers=auth, json={"max_running_sequences": 1})
        assert changed.json()["max_running_sequences"] == 1
        body = {"input_ids": [2], "parameters": {"max_tokens": 3}}
        answers = await asyncio.gather(*(client.post(URL, json=body) for _ in range(3)))
        assert all(a.status_code == 200 for a in answers)
        assert all(len(step) == 1 for step in fake.steps)  # one sequence at a time
        refused = await client.put(url, headers=auth, json={"max_running_sequences": 5})
        assert refused.status_code == 400
        assert "from 1 to kv_slots=4, got 5" in refused.json()["error"]
        assert (await client.get(url)).status_code in (401, 403)


async def test_the_admin_route_changes_the_prefill_knobs_and_refuses_bad_ones() -> None:
    token = "a-long-enough-admin-token-for-tests"
    fake = FakeGenerationReplica(make_info(kv_slots=4))
    async with serve(fake, admin_token=token) as client:
        auth = {"Authorization": f"Bearer {token}"}
        url = "/admin/models/fake/generation"
        change = {"prefill_timeout_ms": 0, "prefill_budget_tokens": 2}
        changed = await client.put(url, headers=auth, json=change)
        assert changed.status_code == 200, changed.text
        assert {k: changed.json()[k] for k in change} == {
            "prefill_timeout_ms": 0.0,
            "prefill_budget_tokens": 2,
        }
        bodies = [{"input_ids": [i + 1, i + 2], "parameters": {"max_tokens": 2}} for i in range(3)]
        answers = await asyncio.gather(*(client.post(URL, json=b) for b in bodies))
        assert [a.json()["output_ids"] for a in answers] == [
            expected_ids([i + 1, i + 2], 2) for i in range(3)
        ]
        # Two tokens of prompt per step: never two prefills in one step.
        assert all(sum(r.position == 0 for r in step) <= 1 for step in fake.steps)
        for bad, says in (
            ({"prefill_budget_tokens": 0}, "prefill_budget_tokens must be an integer from 1"),
            ({"prefill_timeout_ms": -3}, "prefill_timeout_ms must be a number of ms from 0"),
            ({"prefill_timeout_ms": "later"}, "prefill_timeout_ms"),
            ({"max_running_sequences": 9, "prefill_budget_tokens": 8}, "kv_slots=4, got 9"),
            ({"slots": 1}, "slots"),
            ({}, "it named none"),
        ):
            refused = await client.put(url, headers=auth, json=bad)
            assert refused.status_code == 400, (bad, refused.text)
            assert says in refused.json()["error"], (bad, refused.text)
        view = (await client.get(url, headers=auth)).json()
        assert (view["prefill_budget_tokens"], view["max_running_sequences"]) == (2, 4)
        reset = await client.put(
            url, headers=auth, json={"prefill_timeout_ms": "auto", "prefill_budget_tokens": None}
        )
        assert {k: reset.json()[k] for k in change} == {
            "prefill_timeout_ms": "auto",
            "prefill_budget_tokens": None,
        }


async def test_the_openapi_document_lists_the_generate_routes_of_generating_models_only() -> None:
    from tests.serving.served_app import serve as serve_runner

    async with serve(FakeGenerationReplica()) as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
        route = paths["/v2/models/{name}/generate"]["post"]
        name = next(p for p in route["parameters"] if p["name"] == "name")
        assert name["schema"]["enum"] == ["fake"]
    async with serve_runner(FakeRunner()) as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert not [path for path in paths if "/generat" in path]


async def test_client_data_in_a_refusal_is_quoted_short() -> None:
    async with serve(FakeGenerationReplica()) as client:
        body = {"input_ids": [1], "parameters": {"k" * 100_000: 1}}
        answer = await client.post(URL, json=body)
        assert answer.status_code == 400
        message = assert_clean_error(answer)
        assert "unknown parameter 'kkkk" in message and len(message) < 300
