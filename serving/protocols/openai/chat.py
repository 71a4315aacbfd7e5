"""``POST /v1/chat/completions``: OpenAI's chat API, where the model has a chat template.

    {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 32,
     "temperature": 0, "stop": ["\\n"], "logprobs": false, "stream": false}
->  {"id", "object": "chat.completion", "created", "model",
     "choices": [{"index": 0, "message": {"role": "assistant", "content"}, "finish_reason",
                  "logprobs"}], "usage"}

The messages become one prompt through the model's ``chat_template`` setting (its
``config.toml``, or ``--chat-template``): a Jinja2 template as Hugging Face's ``chat_template``,
given ``messages``, ``add_generation_prompt`` (true), ``bos_token`` and ``eos_token``, rendered in
Jinja2's ``ImmutableSandboxedEnvironment`` (a template reaches no Python attribute that is not
safe, and changes no object it is given). keras_hub presets carry no template and none is made
up: without one the route answers 400 saying how to give one. The rendered text is tokenized as a
text prompt is (the preset's start token first where it adds one). ``max_tokens`` (or
``max_completion_tokens``) defaults to what the slot leaves.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import Receive, Scope, Send

from serving.errors import InvalidInputError, ShardServeError
from serving.generation.text_run import ChoiceDelta
from serving.http.fast import FastRequest, ModelRef
from serving.http.replies import JSON, Reply
from serving.protocols.contract import ModelHandle
from serving.protocols.openai.body import (
    OpenAICall,
    check_fields,
    check_prompt_length,
    generation_params,
    stream_flags,
)
from serving.protocols.openai.errors import FieldError, error_object
from serving.protocols.openai.route import (
    Collected,
    collect,
    head,
    new_run,
    serve_body,
    tokenizer_of,
    usage,
)
from serving.protocols.streaming import EventSource, stream_events
from serving.quoting import quote
from serving.settings.generation import is_inline_template

if TYPE_CHECKING:
    from jinja2 import Template

    from serving.generation.engine import Generator
    from serving.generation.tokenizer import TextTokenizer

__all__ = ["render_chat", "v1_chat_completions"]

_OWN = frozenset({"messages", "logprobs", "top_logprobs", "max_completion_tokens"})
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_NO_TEMPLATE = (
    "this model has no chat template (keras_hub presets carry none, and this server makes none "
    "up): give one as chat_template in the model's config.toml (the Jinja2 text, as Hugging "
    "Face's tokenizer_config.json has it) or with --chat-template FILE, or send the prompt "
    "yourself to POST /v1/completions"
)


async def v1_chat_completions(ref: ModelRef, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/chat/completions`` (a fast route's ``RawHandler``; the model is the body's)."""
    await serve_body(scope, receive, send, _chat)


@functools.lru_cache(maxsize=16)
def _template(setting: str) -> Template:
    """The setting's template compiled once (a file read once: a change needs a reload)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise InvalidInputError(f"the chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    source = setting if is_inline_template(setting) else Path(setting).read_text("utf-8")
    return env.from_string(source)


def render_chat(setting: str, messages: list[dict[str, Any]], tokenizer: TextTokenizer,
                generator: Generator) -> str:  # fmt: skip
    """The prompt the template makes of ``messages``; a template error is a 400."""
    from jinja2 import TemplateError

    info = generator.info
    bos = tokenizer.decode([info.start_token_id]) if info.start_token_id is not None else ""
    eos = tokenizer.decode([info.end_token_ids[0]]) if info.end_token_ids else ""
    try:
        template = _template(setting)
        return template.render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
        )
    except TemplateError as exc:
        raise InvalidInputError(
            f"the chat template failed on these messages: {type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise FieldError("messages must be a non-empty list of messages", "messages")
    messages = []
    for index, message in enumerate(value):
        field = f"messages[{index}]"
        if not isinstance(message, dict):
            raise FieldError(f"{field} must be an object with role and content", field)
        role = message.get("role")
        if role not in _ROLES:
            raise FieldError(
                f"{field}.role is {quote(role)}; one of {', '.join(sorted(_ROLES))}", field
            )
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise FieldError(f"{field}.content: only text parts are served", field)
                if not isinstance(part.get("text"), str):
                    raise FieldError(f"{field}.content: a text part's text must be a string", field)
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise FieldError(f"{field}.content must be a string or a list of text parts", field)
        messages.append({**message, "content": content})
    return messages


def parse_chat(
    request: dict[str, Any], model: ModelHandle, generator: Generator, tokenizer: TextTokenizer
) -> OpenAICall:
    check_fields(request, _OWN)
    setting = model.settings.chat_template
    if setting is None:
        raise InvalidInputError(_NO_TEMPLATE)
    if "messages" not in request:
        raise FieldError("messages is missing: send a list of messages", "messages")
    text = render_chat(setting, _messages(request["messages"]), tokenizer, generator)
    info = generator.info
    room = info.max_length * tokenizer.max_token_bytes
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > room:  # before tokenizing: its cost stays a small multiple of its size
        raise FieldError(
            f"messages make a prompt of {size} bytes; a slot of {info.max_length} tokens holds "
            f"at most {room} bytes of text",
            "messages",
        )
    prompt = tuple(tokenizer.encode(text))
    check_prompt_length(prompt, info, "messages")
    if "max_completion_tokens" in request:
        request = {**request, "max_tokens": request["max_completion_tokens"]}
    params, stops = generation_params(request, len(prompt), info, None)
    logprobs = request.get("logprobs")
    if logprobs not in (None, True, False):
        raise FieldError(f"logprobs must be true or false, got {quote(logprobs)}", "logprobs")
    top = request.get("top_logprobs")
    if top not in (None, 0, 1) or isinstance(top, bool):
        raise FieldError(
            f"top_logprobs is {quote(top)}; this server gives the sampled token only (0 or 1)",
            "top_logprobs",
        )
    stream, include_usage = stream_flags(request)
    return OpenAICall(
        (prompt,), params, stops, stream, include_usage, bool(logprobs), request.get("priority")
    )


async def _chat(
    request: FastRequest, body: dict[str, Any], model: ModelHandle, generator: Generator
) -> Reply:
    tokenizer = tokenizer_of(generator)
    call = parse_chat(body, model, generator, tokenizer)
    run = new_run(request, call, model, generator)
    if call.stream:
        top = head("chat.completion.chunk", request, body.get("model"), model)
        greeted: set[int] = set()

        def chunks(deltas: list[ChoiceDelta]) -> list[object]:
            out: list[object] = []
            for d in deltas:
                delta: dict[str, Any] = {"content": d.text}
                if d.index not in greeted:  # OpenAI's first delta of a choice names its role
                    greeted.add(d.index)
                    delta = {"role": "assistant", **delta}
                choice = {
                    "index": d.index,
                    "delta": delta,
                    "finish_reason": d.finish_reason,
                    "logprobs": _logprobs(d, tokenizer) if call.logprobs else None,
                }
                out.append({**top, "choices": [choice]})
            return out

        def error(exc: ShardServeError) -> object:
            return error_object(exc)

        def last(_: object) -> list[object]:
            return [{**top, "choices": [], "usage": usage(run)}] if call.include_usage else []

        source = EventSource(chunks, error, last)
        return await request.until_disconnect(stream_events(request, run, source))
    choices = await collect(request, run)
    answer = {
        **head("chat.completion", request, body.get("model"), model),
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "finish_reason": c.finish_reason,
                "logprobs": _logprobs(c, tokenizer) if call.logprobs else None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(run),
    }
    return 200, orjson.dumps(answer), JSON, []


def _logprobs(part: ChoiceDelta | Collected, tokenizer: TextTokenizer) -> dict[str, Any]:
    content = []
    for token_id, logprob in zip(part.token_ids, part.logprobs, strict=True):
        token = tokenizer.decode([token_id])
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        content.append({**entry, "top_logprobs": [entry]})
    return {"content": content}
