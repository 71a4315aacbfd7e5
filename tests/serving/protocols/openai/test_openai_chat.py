"""``POST /v1/chat/completions`` in process over the fake replica: a chat template given in
code renders the messages into the prompt; without one, a 400 that says how to give one; a
template runs sandboxed; the stream's deltas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from serving.generation.tokenizer import ByteBPETokenizer
from tests.generation_fakes import END_ID, FakeGenerationReplica, expected_ids, make_info
from tests.generation_models import GPT2_MERGES, GPT2_VOCABULARY
from tests.serving.protocols.v2.test_v2_generate import serve

URL = "/v1/chat/completions"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
HELLO = [{"role": "system", "content": "be"}, {"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ByteBPETokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    (directory / "vocabulary.json").write_text(json.dumps(GPT2_VOCABULARY))
    (directory / "merges.txt").write_text("".join(f"{m}\n" for m in GPT2_MERGES))
    return ByteBPETokenizer(directory, start_token_id=END_ID)


def _fake() -> FakeGenerationReplica:
    return FakeGenerationReplica(make_info(vocabulary_size=len(GPT2_VOCABULARY)))


async def test_the_template_makes_the_prompt(tokenizer: ByteBPETokenizer) -> None:
    fake = _fake()
    async with serve(fake, tokenizer, chat_template=TEMPLATE) as client:
        body = {"model": "fake", "messages": HELLO, "max_tokens": 3, "temperature": 0}
        answer = await client.post(URL, json=body)
        assert answer.status_code == 200, answer.text
        got = answer.json()
        prompt = tokenizer.encode("s:be\nu:hi\na:")
        assert list(fake.steps[-3][0].token_ids) == prompt
        want = tokenizer.decode(expected_ids(prompt, 3))
        assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")
        assert got["choices"] == [
            {
                "index": 0,
                "message": {"role": "assistant", "content": want},
                "finish_reason": "length",
                "logprobs": None,
            }
        ]
        assert got["usage"]["prompt_tokens"] == len(prompt)


async def test_a_template_file_and_a_stream(tokenizer: ByteBPETokenizer, tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    async with serve(_fake(), tokenizer, chat_template=str(path)) as client:
        body = {"messages": HELLO, "max_tokens": 4, "stream": True}
        answer = await client.post(URL, json=body)
        events = [e for e in answer.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        prompt = tokenizer.encode("s:be\nu:hi\na:")
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text == tokenizer.decode(expected_ids(prompt, 4))
        assert chunks[-1]["object"] == "chat.completion.chunk"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_without_a_template_a_400_says_how_to_give_one(tokenizer: ByteBPETokenizer) -> None:
    async with serve(_fake(), tokenizer) as client:
        answer = await client.post(URL, json={"messages": HELLO})
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "chat_template" in message and "--chat-template" in message


BAD: list[tuple[Any, str, str]] = [
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]", "role is 'wizard'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0]", "content must be a string"),
    ({"messages": HELLO, "logprobs": 3}, "logprobs", "logprobs must be true or false"),
    ({"messages": HELLO, "top_logprobs": 5}, "top_logprobs", "top_logprobs is 5"),
    ({"messages": HELLO, "max_completion_tokens": 99}, "max_tokens", "max_tokens is 99"),
    ({"messages": HELLO, "n": 3}, "n", "one choice per prompt"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD)
async def test_each_bad_field_is_a_400_naming_it(
    tokenizer: ByteBPETokenizer, body: Any, param: str, message: str
) -> None:
    async with serve(_fake(), tokenizer, chat_template=TEMPLATE) as client:
        answer = await client.post(URL, json=body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert message in error["message"] and error["param"] == param


async def test_the_template_runs_sandboxed(tokenizer: ByteBPETokenizer) -> None:
    unsafe = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    mutating = "{{ messages.append(1) }}"
    for template in (unsafe, mutating):
        async with serve(_fake(), tokenizer, chat_template=template) as client:
            answer = await client.post(URL, json={"messages": HELLO})
            assert answer.status_code == 400, answer.text
            assert "the chat template failed" in answer.json()["error"]["message"]


async def test_a_template_may_refuse_messages(tokenizer: ByteBPETokenizer) -> None:
    refusing = "{{ raise_exception('no system role here') }}"
    async with serve(_fake(), tokenizer, chat_template=refusing) as client:
        answer = await client.post(URL, json={"messages": HELLO})
        assert answer.status_code == 400
        assert "no system role here" in answer.json()["error"]["message"]


def test_a_chat_template_setting_is_a_template_or_a_file(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from serving.settings.config import Settings

    with pytest.raises(ValidationError, match="neither a Jinja2 template"):
        Settings(model="m", chat_template=str(tmp_path / "missing.jinja"))
    assert Settings(model="m", chat_template=TEMPLATE).chat_template == TEMPLATE
