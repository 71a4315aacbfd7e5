"""What an OpenAI completions or chat body asks, checked before any work: each refusal a 400 in
OpenAI's shape naming its field (``param``).

The fields a client sends at their neutral value (``frequency_penalty: 0``, ``n: 1``,
``echo: false``, ...) are taken; any other value of them, and any field not known, is refused
by name rather than silently ignored (``user`` is ignored, as OpenAI's own servers use it only
for abuse monitoring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from serving.errors import InvalidInputError
from serving.generation.request import check_ids, tokenize_text
from serving.generation.sequence import GenerationParams
from serving.generation.tokenizer import TextTokenizer
from serving.protocols.openai.errors import FieldError
from serving.quoting import quote
from shards.generation.contract import GenerationInfo, Sampling

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "OpenAICall",
    "check_fields",
    "check_prompt_length",
    "generation_params",
    "load_object",
    "model_ref",
    "prompts_of",
    "stream_flags",
]

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default
_SEED_LIMIT = 2**63
_MAX_STOPS = 4  # OpenAI's limit
_MAX_STOP_CHARACTERS = 256
# Fields taken only at their neutral value: what a client library sends by default.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None,),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "user": (),  # any value: ignored
}
_SAMPLING = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"}
    | {"stream_options", "priority"}
)


@dataclass(frozen=True)
class OpenAICall:
    prompts: tuple[tuple[int, ...], ...]  # one choice each
    params: GenerationParams
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool  # the sampled token's log-probability of each generated token
    # ``priority`` as sent (``Levels.resolve`` checks it against the model's levels).
    priority: object = None


def load_object(body: bytes | bytearray) -> dict[str, Any]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidInputError("the body must be a JSON object")
    return request


def model_ref(value: object) -> tuple[str | None, str | None, str | None]:
    """``model``: ``name``, ``name:version`` or ``name@label`` (absent: the default model)."""
    if value is None:
        return None, None, None
    if not isinstance(value, str) or not value:
        raise FieldError(f"model must be a model's name, got {quote(value)}", "model")
    if "@" in value:
        name, label = value.split("@", 1)
        return name, None, label
    if ":" in value:
        name, version = value.split(":", 1)
        return name, version, None
    return value, None, None


def check_fields(request: dict[str, Any], own: frozenset[str]) -> None:
    known = _SAMPLING | own | set(_NEUTRAL)
    unknown = sorted(set(request) - known)
    if unknown:
        raise FieldError(
            f"unknown field {quote(unknown[0])}; this server takes: {', '.join(sorted(known))}",
            unknown[0],
        )
    for name, allowed in _NEUTRAL.items():
        if allowed and name in request and request[name] not in allowed:
            if name == "n":
                raise FieldError(
                    f"n is {quote(request[name])}; this server generates one choice per prompt "
                    "(n = 1): send the prompt n times in a list for n choices",
                    "n",
                )
            raise FieldError(
                f"{name} is {quote(request[name])}; this server does not implement {name} "
                f"(leave it out, or send {allowed[-1]!r})",
                name,
            )


def prompts_of(
    value: object, info: GenerationInfo, tokenizer: TextTokenizer
) -> list[tuple[int, ...]]:
    """``prompt``: a string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [_text(value, "prompt", info, tokenizer)]
    if not isinstance(value, list) or not value:
        raise FieldError(
            "prompt must be a string, a list of token ids, or a list of either (one choice each)",
            "prompt",
        )
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [_ids(value, "prompt", info)]
    prompts = []
    for index, item in enumerate(value):
        field = f"prompt[{index}]"
        if isinstance(item, str):
            prompts.append(_text(item, field, info, tokenizer))
        elif isinstance(item, list) and item:
            prompts.append(_ids(item, field, info))
        else:
            raise FieldError(f"{field} must be a string or a non-empty list of token ids", field)
    return prompts


def _text(
    value: str, field: str, info: GenerationInfo, tokenizer: TextTokenizer
) -> tuple[int, ...]:
    try:
        return tokenize_text(value, info, tokenizer, field, "a list of token ids")
    except InvalidInputError as exc:
        raise FieldError(exc.message, field) from None


def _ids(value: list[Any], field: str, info: GenerationInfo) -> tuple[int, ...]:
    try:
        return check_ids(value, field, info)
    except InvalidInputError as exc:
        raise FieldError(exc.message, field) from None


def check_prompt_length(prompt: tuple[int, ...], info: GenerationInfo, field: str) -> None:
    limit = info.max_length
    if len(prompt) >= limit:
        raise FieldError(
            f"{field} is {len(prompt)} tokens; this model's slots hold {limit} "
            f"(max_sequence_length), prompt and generated tokens together: send at most "
            f"{limit - 1}",
            field,
        )


def generation_params(
    request: dict[str, Any], longest: int, info: GenerationInfo, default_max_tokens: int | None
) -> tuple[GenerationParams, tuple[str, ...]]:
    """The sampling, ``max_tokens`` (``None`` default: what the slot leaves the longest
    prompt) and the stop strings."""
    room = info.max_length - longest
    max_tokens = _int(request, "max_tokens", default_max_tokens or room, low=1)
    if max_tokens > room:
        raise FieldError(
            f"max_tokens is {max_tokens}; a prompt of {longest} tokens leaves room for {room} "
            f"in a slot of {info.max_length} (max_sequence_length)",
            "max_tokens",
        )
    temperature = _number(request, "temperature", 1.0)
    if temperature < 0:
        raise FieldError(
            f"temperature is {temperature:g}; it must be 0 (greedy) or more", "temperature"
        )
    top_p = _number(request, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise FieldError(f"top_p is {top_p:g}; it must be in (0, 1]", "top_p")
    top_k = request.get("top_k")
    top_k = 0 if top_k in (None, -1) else _int(request, "top_k", 0, low=0)  # vLLM's -1: off
    seed = request.get("seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _SEED_LIMIT
    ):
        raise FieldError(f"seed must be an integer from 0 to 2**63-1, got {quote(seed)}", "seed")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    params = GenerationParams(
        max_tokens=max_tokens, sampling=sampling, stop_ids=frozenset(info.end_token_ids)
    )
    return params, _stops(request.get("stop"))


def stream_flags(request: dict[str, Any]) -> tuple[bool, bool]:
    stream = request.get("stream")
    if stream not in (None, True, False):
        raise FieldError(f"stream must be true or false, got {quote(stream)}", "stream")
    options = request.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise FieldError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise FieldError(
            'stream_options must be an object of at most {"include_usage": true|false}',
            "stream_options",
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise FieldError("stream_options.include_usage must be true or false", "stream_options")
    return True, usage


def _stops(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= _MAX_STOP_CHARACTERS for s in stops)
    ):
        raise FieldError(
            f"stop must be a string or a list of at most {_MAX_STOPS} non-empty strings of at "
            f"most {_MAX_STOP_CHARACTERS} characters, got {quote(value)}",
            "stop",
        )
    return tuple(stops)


def _int(request: dict[str, Any], name: str, default: int, *, low: int) -> int:
    value = request.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise FieldError(f"{name} must be an integer of at least {low}, got {quote(value)}", name)
    return value


def _number(request: dict[str, Any], name: str, default: float) -> float:
    value = request.get(name)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise FieldError(f"{name} must be a finite number, got {quote(value)}", name)
    return float(value)
