"""A real ``shardserve serve --model <GPT-2 preset>`` in 2 stages on Ray (issue 39), its LM head
split by vocabulary rows into 2 part actors (``--head-parts 2``, issue 42; the unsplit head is
served end to end by tests/e2e/test_generate_priorities.py): 8 concurrent prompts of different
lengths and max_tokens answer keras_hub's own greedy ids, through the generate route; text in,
text out; a client that hangs up frees its slot; a stage killed (SIGKILL) mid-generation costs no
client a token. The ``openai`` client (issue 40): completions
and chat, plain and streamed, equal to the greedy ids' text; a stop string spanning tokens cut
exactly, plain and streamed; each bad field a 400 in OpenAI's shape; a stream cut mid-way frees
its slot."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import orjson
import pytest

from serving.generation.tokenizer import ByteBPETokenizer
from tests.generation_models import Greedy
from tests.metrics_text import metric
from tests.serverproc import Server, ray_env, running_server
from tests.serving.protocols.openai.test_openai_completions import BAD

KV_SLOTS = 8
HEAD_PARTS = 2
ADMIN_TOKEN = "generate-server-admin-token"
LABELS = {"model": "gpt", "version": "1"}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def gpt2_server(
    tmp_path_factory: pytest.TempPathFactory, ray_address: str, gpt2_greedy: Greedy
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("gpt2-server")
    template = workdir / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = [
        "--model", str(gpt2_greedy.preset),
        "--model-name", "gpt",
        "--stages", "2",
        "--head-parts", str(HEAD_PARTS),
        # 2 stages + 2 head parts: 2 of the session Ray's 4 CPUs, as 2 stages of 1 CPU were.
        "--cpus-per-shard", "0.5",
        "--kv-slots", str(KV_SLOTS),
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
        "--chat-template", str(template),
        "--admin-token", ADMIN_TOKEN,
    ]  # fmt: skip
    with running_server(args, workdir) as server:
        yield server


def _metrics(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics").text


def _actors(server: Server, kind: str) -> list[Any]:
    """The server's actor processes of the class ``kind``: children of the session's raylet
    (tests/conftest.py's one local Ray) whose title names the class, started after the server."""
    import psutil
    import ray

    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    started = psutil.Process(server.process.pid).create_time()
    return [
        p
        for p in psutil.Process(raylet).children(recursive=True)
        if kind in " ".join(p.cmdline()) and p.create_time() >= started
    ]


def test_concurrent_prompts_get_keras_hubs_greedy_ids(
    gpt2_server: Server, gpt2_greedy: Greedy
) -> None:
    # The head is in its part actors: the ids below are merged from their slices.
    assert len(_actors(gpt2_server, "HeadPart")) == HEAD_PARTS
    # 8 prompts: the fixture's 5, and 3 of them again, each with its own max_tokens.
    cases = [
        (prompt, max(1, len(ids) - k))
        for k, (prompt, ids) in enumerate(
            zip(gpt2_greedy.prompts, gpt2_greedy.generated, strict=True)
        )
    ]
    cases += [(gpt2_greedy.prompts[i], n) for i, n in ((0, 3), (2, 9), (4, 1))]
    assert len(cases) == 8
    before = metric(_metrics(gpt2_server), "shardserve_generation_step_rows_sum", **LABELS)
    steps_before = metric(_metrics(gpt2_server), "shardserve_generation_step_rows_count", **LABELS)

    async def ask_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gpt2_server.url, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v2/models/gpt/generate",
                        json={
                            "input_ids": list(prompt),
                            "parameters": {"max_tokens": n, "stop_token_ids": []},
                        },
                    )
                    for prompt, n in cases
                )
            )

    answers = asyncio.run(ask_all())
    for (prompt, n), answer in zip(cases, answers, strict=True):
        assert answer.status_code == 200, answer.text
        want = list(gpt2_greedy.generated[gpt2_greedy.prompts.index(prompt)][:n])
        assert answer.json()["output_ids"] == want, (prompt, n)
        assert answer.json()["finish_reason"] == "length"
    text = _metrics(gpt2_server)
    rows = metric(text, "shardserve_generation_step_rows_sum", **LABELS) - before
    steps = metric(text, "shardserve_generation_step_rows_count", **LABELS) - steps_before
    assert rows / steps > 1  # sequences at different positions shared steps
    assert metric(text, "shardserve_free_kv_slots", **LABELS) == KV_SLOTS


def test_the_knobs_change_at_run_time_through_the_admin_route(
    gpt2_server: Server, gpt2_greedy: Greedy
) -> None:
    url = f"{gpt2_server.url}/admin/models/gpt/generation"
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    one_at_a_time = {
        "max_running_sequences": 1,
        "prefill_budget_tokens": 1,
        "prefill_timeout_ms": 0,
    }
    changed = httpx.put(url, headers=auth, json=one_at_a_time, timeout=30)
    assert changed.status_code == 200, changed.text
    assert {k: changed.json()[k] for k in one_at_a_time} == one_at_a_time
    refused = httpx.put(url, headers=auth, json={"max_running_sequences": KV_SLOTS + 1})
    assert refused.status_code == 400
    assert f"from 1 to kv_slots={KV_SLOTS}, got {KV_SLOTS + 1}" in refused.json()["error"]
    before = metric(_metrics(gpt2_server), "shardserve_generation_step_rows_sum", **LABELS)
    steps_before = metric(_metrics(gpt2_server), "shardserve_generation_step_rows_count", **LABELS)

    async def ask_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gpt2_server.url, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v2/models/gpt/generate",
                        json={
                            "input_ids": list(prompt),
                            "parameters": {"max_tokens": 3, "stop_token_ids": []},
                        },
                    )
                    for prompt in gpt2_greedy.prompts[:3]
                )
            )

    try:
        answers = asyncio.run(ask_all())
        for prompt, answer in zip(gpt2_greedy.prompts, answers, strict=False):
            assert answer.status_code == 200, answer.text
            want = list(gpt2_greedy.generated[gpt2_greedy.prompts.index(prompt)][:3])
            assert answer.json()["output_ids"] == want
        text = _metrics(gpt2_server)
        rows = metric(text, "shardserve_generation_step_rows_sum", **LABELS) - before
        steps = metric(text, "shardserve_generation_step_rows_count", **LABELS) - steps_before
        assert rows == steps == 9  # one sequence at a time: each step one row
    finally:
        back = {"max_running_sequences": KV_SLOTS, "prefill_budget_tokens": None}
        reset = httpx.put(url, headers=auth, json={**back, "prefill_timeout_ms": "auto"})
        assert reset.status_code == 200, reset.text


def test_tune_generate_sweeps_the_knobs_and_puts_them_back(
    gpt2_server: Server, gpt2_greedy: Greedy, tmp_path: Path
) -> None:
    """A small real sweep: two budgets, one point each, through the admin route."""
    workload = tmp_path / "workload.json"
    prompts = [list(p) for p in gpt2_greedy.prompts[:3]]
    workload.write_text(
        json.dumps({"prompts": prompts, "max_tokens": [2, 4], "route": "v2", "stop": False})
    )
    out = tmp_path / "tune"
    command = [
        sys.executable, "-m", "serving.cli.main", "tune", "--generate", "--url", gpt2_server.url,
        "--model-name", "gpt", "--workload", str(workload), "--prefill-timeouts", "auto",
        "--max-running", str(KV_SLOTS), "--prefill-budgets", "none,4", "--loads", "2",
        "--duration", "2", "--warmup", "1", "--ttft-p95-ms", "60000", "--out", str(out),
        "--admin-token", ADMIN_TOKEN,
    ]  # fmt: skip
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=ray_env(), check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["load"], r["prefill_budget_tokens"]) for r in rows] == [("c=2", ""), ("c=2", "4")]
    assert all(int(r["streams"]) > 0 and int(r["failures"]) == 0 for r in rows), rows
    assert all(float(r["tokens_per_s"]) > 0 and r["ttft_p95_ms"] for r in rows), rows
    assert "**winner**" in (out / "report.md").read_text()
    assert tomllib.loads((out / "recommended.toml").read_text())["shardserve"]
    assert (out / "ttft_tokens.png").stat().st_size > 0
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    knobs = httpx.get(f"{gpt2_server.url}/admin/models/gpt/generation", headers=auth).json()
    assert (knobs["prefill_timeout_ms"], knobs["prefill_budget_tokens"]) == ("auto", None)


def test_text_in_text_out(gpt2_server: Server) -> None:
    answer = httpx.post(
        f"{gpt2_server.url}/v2/models/gpt/generate",
        json={"text_input": "the cat", "parameters": {"max_tokens": 4, "stop_token_ids": []}},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["output_ids"]) == 4 and isinstance(body["text_output"], str)
    assert set(body) == {
        "model_name",
        "model_version",
        "text_output",
        "output_ids",
        "finish_reason",
    }


def test_a_client_that_hangs_up_frees_its_slot(gpt2_server: Server) -> None:
    url = urlparse(gpt2_server.url)
    tokens_before = metric(_metrics(gpt2_server), "shardserve_generated_tokens_total", **LABELS)
    max_tokens = 30
    body = orjson.dumps(
        {"input_ids": [5], "parameters": {"max_tokens": max_tokens, "stop_token_ids": []}}
    )
    head = (
        f"POST /v2/models/gpt/generate HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 30
        while metric(_metrics(gpt2_server), "shardserve_running_sequences", **LABELS) < 1:
            assert time.monotonic() < deadline, "the sequence never ran"
    # Hung up while it ran: its slot is free again, short of its max_tokens.
    deadline = time.monotonic() + 30
    while True:
        text = _metrics(gpt2_server)
        if metric(text, "shardserve_free_kv_slots", **LABELS) == KV_SLOTS:
            break
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    assert metric(text, "shardserve_running_sequences", **LABELS) == 0
    generated = metric(text, "shardserve_generated_tokens_total", **LABELS) - tokens_before
    assert generated < max_tokens


def test_a_stage_killed_mid_generation_costs_no_client_a_token(
    gpt2_server: Server, gpt2_greedy: Greedy
) -> None:
    stages = _actors(gpt2_server, "GenerationStage")
    assert len(stages) == 2, stages
    cases = [
        (p, len(ids)) for p, ids in zip(gpt2_greedy.prompts, gpt2_greedy.generated, strict=True)
    ]

    async def ask_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gpt2_server.url, timeout=120) as client:
            calls = [
                asyncio.ensure_future(
                    client.post(
                        "/v2/models/gpt/generate",
                        json={
                            "input_ids": list(p),
                            "parameters": {"max_tokens": n, "stop_token_ids": []},
                        },
                    )
                )
                for p, n in cases
            ]
            while (
                metric(
                    (await client.get("/metrics")).text, "shardserve_running_sequences", **LABELS
                )
                < 1
            ):
                pass
            os.kill(stages[0].pid, signal.SIGKILL)  # kill -9
            return await asyncio.gather(*calls)

    answers = asyncio.run(ask_all())
    for (prompt, n), answer, ids in zip(cases, answers, gpt2_greedy.generated, strict=True):
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_ids"] == list(ids[:n]), prompt
    assert "was lost" in gpt2_server.output()


def _openai(server: Server) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _v2_text(server: Server, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"text_input": text, "parameters": {"max_tokens": max_tokens}}
    answer = httpx.post(f"{server.url}/v2/models/gpt/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_the_openai_client_completes_as_the_greedy_generate(
    gpt2_server: Server, gpt2_greedy: Greedy
) -> None:
    tokenizer = ByteBPETokenizer(gpt2_greedy.preset / "assets" / "tokenizer")
    end = 0  # <|endoftext|>: the preset's end token, a stop id of the OpenAI routes
    # The prompt whose greedy ids run longest before an end token.
    prompt, ids = max(
        zip(gpt2_greedy.prompts, gpt2_greedy.generated, strict=True),
        key=lambda p: list(p[1]).index(end) if end in p[1] else len(p[1]),
    )
    n = min(8, list(ids).index(end) if end in ids else len(ids))
    want = tokenizer.decode(ids[:n])
    client = _openai(gpt2_server)
    done = client.completions.create(model="gpt", prompt=list(prompt), max_tokens=n, temperature=0)
    assert done.choices[0].text == want
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == n
    chunks = client.completions.create(
        model="gpt", prompt=list(prompt), max_tokens=n, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    # A text prompt: the same text as the generate route's for it, plain and streamed.
    done = client.completions.create(model="gpt", prompt="the cat", max_tokens=4, temperature=0)
    assert done.choices[0].text == _v2_text(gpt2_server, "the cat", 4)["text_output"]
    chunks = client.completions.create(
        model="gpt", prompt="the cat", max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text


def test_the_openai_client_reads_our_errors(gpt2_server: Server) -> None:
    import openai

    client = _openai(gpt2_server)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="gpt", prompt="the cat", n=2)
    assert (bad.value.param, bad.value.type) == ("n", "invalid_request_error")
    assert "one choice per prompt" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="nope", prompt="the cat")
    assert missing.value.code == "model_not_found"


def _spanning_stop(tokenizer: ByteBPETokenizer, gpt2_greedy: Greedy) -> tuple[Any, ...]:
    """A prompt, its greedy ids up to the end token, and a two-character stop string whose
    first occurrence in their text spans the boundary between tokens ``k - 1`` and ``k``."""
    end = 0  # <|endoftext|>: the OpenAI routes stop there
    for prompt, generated in zip(gpt2_greedy.prompts, gpt2_greedy.generated, strict=True):
        ids = list(generated[: generated.index(end)] if end in generated else generated)
        pieces = [tokenizer.decode([i]) for i in ids]
        text = "".join(pieces)
        assert text == tokenizer.decode(ids)  # an ASCII vocabulary: each token its own text
        for k in range(2, len(ids)):
            stop = pieces[k - 1][-1] + pieces[k][0]
            if text.find(stop) == len("".join(pieces[:k])) - 1:
                return prompt, ids, k, stop, text[: text.find(stop)]
    raise AssertionError("no greedy text has a stop string across two tokens")


def test_a_stop_string_spanning_tokens_is_cut_exactly(
    gpt2_server: Server, gpt2_greedy: Greedy
) -> None:
    tokenizer = ByteBPETokenizer(gpt2_greedy.preset / "assets" / "tokenizer")
    prompt, ids, k, stop, want = _spanning_stop(tokenizer, gpt2_greedy)
    client = _openai(gpt2_server)
    asked = {"model": "gpt", "prompt": list(prompt), "max_tokens": len(ids), "temperature": 0}
    done = client.completions.create(**asked, stop=["\u00e9", stop])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (want, "stop")
    assert done.usage is not None and done.usage.completion_tokens == k + 1  # up to its end
    chunks = list(client.completions.create(**asked, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize(("body", "param", "message"), BAD)
def test_each_bad_field_is_a_400_in_openais_shape(
    gpt2_server: Server, body: dict[str, Any], param: str, message: str
) -> None:
    answer = httpx.post(f"{gpt2_server.url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"], error
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "Traceback" not in answer.text


def test_the_openai_client_chats_through_the_template(gpt2_server: Server) -> None:
    client = _openai(gpt2_server)
    messages = [{"role": "user", "content": "hi"}]
    want = _v2_text(gpt2_server, "u:hi\na:", 4)["text_output"]
    done = client.chat.completions.create(
        model="gpt",
        messages=messages,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert done.choices[0].message.content == want
    chunks = client.chat.completions.create(
        model="gpt",
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_a_stream_cut_mid_way_frees_its_slot(gpt2_server: Server) -> None:
    url = urlparse(gpt2_server.url)
    body = orjson.dumps({"model": "gpt", "prompt": [5], "max_tokens": 30, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    tokens_before = metric(_metrics(gpt2_server), "shardserve_generated_tokens_total", **LABELS)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(head + body)
        sock.settimeout(60)
        seen = b""
        while b"data: " not in seen:  # its first token has come
            seen += sock.recv(4096)
        assert b"text/event-stream" in seen
    deadline = time.monotonic() + 30
    while True:
        text = _metrics(gpt2_server)
        if metric(text, "shardserve_running_sequences", **LABELS) == 0:
            break
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    assert metric(text, "shardserve_free_kv_slots", **LABELS) == KV_SLOTS
    generated = metric(text, "shardserve_generated_tokens_total", **LABELS) - tokens_before
    assert generated < 30
