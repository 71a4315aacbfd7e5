"""Priorities on a real ``shardserve serve --model <GPT-2 preset>`` with one KV slot on Ray (issue
41): a high-priority prompt starts before 16 queued low ones and preempts the low sequence that
holds the slot, which still answers keras_hub's greedy ids; a flood of low prompts (their queue
full: 503) does not refuse a high one; a preempted low request past its deadline gets the error
that says it was preempted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.generation_models import Greedy
from tests.metrics_text import metric
from tests.serverproc import Server, running_server

LABELS = {"model": "gpt", "version": "1"}
QUEUED = 16
URL = "/v2/models/gpt/generate"


@pytest.fixture(scope="module")
def one_slot_server(
    tmp_path_factory: pytest.TempPathFactory, ray_address: str, gpt2_greedy: Greedy
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("priority-server")
    args = [
        "--model", str(gpt2_greedy.preset),
        "--model-name", "gpt",
        "--stages", "2",
        "--kv-slots", "1",
        "--max-waiting-prompts", str(QUEUED),
        "--max-preemptions", "1",
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
    ]  # fmt: skip
    with running_server(args, workdir) as server:
        yield server


def _body(prompt: tuple[int, ...], max_tokens: int, priority: str | None = None) -> Any:
    parameters: dict[str, Any] = {"max_tokens": max_tokens, "stop_token_ids": []}
    if priority is not None:
        parameters["priority"] = priority
    return {"input_ids": list(prompt), "parameters": parameters}


async def _gauge(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    return metric((await client.get("/metrics")).text, name, **LABELS, **labels)


async def _until(client: httpx.AsyncClient, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + 60
    while await _gauge(client, name, **labels) != value:
        assert time.monotonic() < deadline, f"{name} {labels} never reached {value}"


def test_a_high_prompt_starts_first_preempts_and_is_never_refused(
    one_slot_server: Server, gpt2_greedy: Greedy
) -> None:
    prompts, generated = gpt2_greedy.prompts, gpt2_greedy.generated
    held = prompts[2]  # one token: room for the longest sequence there is
    longest = 31  # the slot's 32 positions less the prompt's one
    ended: list[str] = []

    async def ask(client: httpx.AsyncClient, tag: str, body: Any, **kw: Any) -> httpx.Response:
        answer = await client.post(URL, json=body, **kw)
        ended.append(tag)
        return answer

    async def scenario() -> tuple[httpx.Response, httpx.Response, list[httpx.Response], Any]:
        async with httpx.AsyncClient(base_url=one_slot_server.url, timeout=300) as client:
            alone = await client.post(URL, json=_body(held, longest))  # the slot to itself
            holder = asyncio.ensure_future(ask(client, "holder", _body(held, longest)))
            await _until(client, "shardserve_running_sequences", 1)
            lows = [
                asyncio.ensure_future(ask(client, f"low{i}", _body(prompts[i % 5], 2)))
                for i in range(QUEUED)
            ]
            await _until(client, "shardserve_waiting_prompts", QUEUED, priority="low")
            flood = await client.post(URL, json=_body(prompts[0], 2))  # its level is full
            assert flood.status_code == 503, flood.text
            # The header's level, as a client that cannot add a field sends it.
            high = await ask(client, "high", _body(prompts[4], 4), headers={"X-Priority": "high"})
            rest = await asyncio.gather(holder, *lows)
            text = (await client.get("/metrics")).text
            return high, rest[0], list(rest[1:]), (text, alone.json()["output_ids"])

    high, holder, lows, (text, alone) = asyncio.run(scenario())
    assert high.status_code == 200, high.text
    assert high.json()["output_ids"] == list(generated[4][:4])
    # The high prompt ended before any of the 16 that queued before it started.
    assert ended.index("high") < min(ended.index(f"low{i}") for i in range(QUEUED))
    # The sequence that held the slot gave it up and still answers its greedy ids exactly.
    assert holder.status_code == 200, holder.text
    assert holder.json()["output_ids"][: len(generated[2])] == list(generated[2])  # keras_hub's
    assert holder.json()["output_ids"] == alone
    assert metric(text, "shardserve_generation_preemptions_total", **LABELS, priority="low") == 1
    for i, low in enumerate(lows):
        assert low.status_code == 200, low.text
        assert low.json()["output_ids"] == list(generated[i % 5][:2])
    assert metric(text, "shardserve_generation_refusals_total", **LABELS, priority="low") == 1
    assert metric(text, "shardserve_generation_refusals_total", **LABELS, priority="high") == 0
    assert metric(text, "shardserve_time_to_first_token_seconds_count", **LABELS, priority="high")


def test_a_preempted_low_request_past_its_deadline_says_it_was_preempted(
    one_slot_server: Server, gpt2_greedy: Greedy
) -> None:
    prompt = gpt2_greedy.prompts[2]

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=one_slot_server.url, timeout=300) as client:
            low = asyncio.ensure_future(
                client.post(
                    URL,
                    json=_body(prompt, len(gpt2_greedy.generated[2])),
                    headers={"X-Request-Timeout-Ms": "1500"},
                )
            )
            await _until(client, "shardserve_running_sequences", 1)
            # Long high prompts, one after another (465 steps): the low one waits past its
            # deadline.
            highs = [
                asyncio.ensure_future(client.post(URL, json=_body(prompt, 31, "high")))
                for _ in range(QUEUED - 1)
            ]
            return await low, list(await asyncio.gather(*highs))

    low, highs = asyncio.run(scenario())
    assert low.status_code == 504, low.text
    assert "preempted 1 time" in low.text
    assert all(h.status_code == 200 for h in highs)
