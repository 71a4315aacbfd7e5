"""What a generate request asks (the KServe/Triton generate extension's body), checked before
any work: each refusal a 400 naming its field.

    {"text_input": "...", "parameters": {"max_tokens": 16, "temperature": 0, "top_k": 0,
     "top_p": 1.0, "seed": 7, "stop_token_ids": [50256], "priority": "high"}}
    {"input_ids": [464, 2068], "parameters": {...}}

A text is refused by its size in bytes before it is tokenized, where it could not fit the slot
even at the longest token of the vocabulary; a prompt with no room left in the slot for
``max_tokens`` is refused once its ids are known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson

from serving.errors import InvalidInputError
from serving.generation.sequence import Completion, GenerationParams
from serving.generation.tokenizer import TextTokenizer
from serving.quoting import quote
from shards.generation.contract import GenerationInfo, Sampling

__all__ = ["GenerateCall", "check_ids", "encode_generate", "parse_generate", "tokenize_text"]

DEFAULT_MAX_TOKENS = 16
_PARAMETERS = frozenset(
    {"max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "priority"}
)
_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class GenerateCall:
    prompt: tuple[int, ...]
    params: GenerationParams
    text: bool  # the prompt came as text: the answer carries text_output
    # parameters.priority as sent (``Levels.resolve`` checks it against the model's levels).
    priority: object = None


def parse_generate(
    body: bytes | bytearray, info: GenerationInfo, tokenizer: TextTokenizer | None
) -> GenerateCall:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInputError(f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise InvalidInputError('the body must be a JSON object with "text_input" or "input_ids"')
    unknown = sorted(set(request) - {"text_input", "input_ids", "parameters", "id"})
    if unknown:
        raise InvalidInputError(
            f"unknown field {quote(unknown[0])}; a generate body holds text_input or "
            "input_ids, and parameters"
        )
    parameters = request.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInputError("parameters must be a JSON object")
    text = "text_input" in request
    if text == ("input_ids" in request):
        raise InvalidInputError("give exactly one of text_input and input_ids")
    limit = info.max_length
    if text:
        prompt = tokenize_text(request["text_input"], info, tokenizer)
    else:
        prompt = check_ids(request["input_ids"], "input_ids", info)
        if not prompt:
            raise InvalidInputError("input_ids is empty; send at least one token id")
    if len(prompt) >= limit:
        raise InvalidInputError(
            f"the prompt is {len(prompt)} tokens; this model's slots hold {limit} "
            f"(max_sequence_length), prompt and generated tokens together: send at most "
            f"{limit - 1}"
        )
    params = _params(parameters, len(prompt), info)
    return GenerateCall(prompt, params, text, parameters.get("priority"))


def tokenize_text(
    text: object,
    info: GenerationInfo,
    tokenizer: TextTokenizer | None,
    field: str = "text_input",
    ids_field: str = "input_ids",
) -> tuple[int, ...]:
    """A text prompt's ids, refused (400 naming ``field``) by its size in bytes before it is
    tokenized where it could not fit a slot."""
    if tokenizer is None:
        raise InvalidInputError(
            f"{field}: this model has no tokenizer (its preset was saved without one) and "
            f"serves token ids only; send {ids_field}"
        )
    if not isinstance(text, str):
        raise InvalidInputError(f"{field} must be a string, got {type(text).__name__}")
    room = info.max_length * tokenizer.max_token_bytes
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > room:  # before tokenizing: its cost stays a small multiple of its size
        raise InvalidInputError(
            f"{field} is {size} bytes; a slot of {info.max_length} tokens holds at most "
            f"{room} bytes of text"
        )
    ids = tokenizer.encode(text)
    if not ids:
        raise InvalidInputError(f"{field} is empty; send at least one character")
    return tuple(ids)


def check_ids(value: object, field: str, info: GenerationInfo) -> tuple[int, ...]:
    """A list of token ids, each in the vocabulary (400 naming ``field`` and the index)."""
    if not isinstance(value, list):
        raise InvalidInputError(f"{field} must be a list of token ids")
    vocabulary = info.vocabulary_size
    for index, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            raise InvalidInputError(
                f"{field}[{index}] must be an integer token id, got {quote(token)}"
            )
        if not 0 <= token < vocabulary:
            raise InvalidInputError(
                f"{field}[{index}] is {quote(token)}, outside the vocabulary (0 to "
                f"{vocabulary - 1})"
            )
    return tuple(value)


def _params(parameters: dict[str, Any], prompt: int, info: GenerationInfo) -> GenerationParams:
    unknown = sorted(set(parameters) - _PARAMETERS)
    if unknown:
        raise InvalidInputError(
            f"unknown parameter {quote(unknown[0])}; known: {', '.join(sorted(_PARAMETERS))}"
        )
    room = info.max_length - prompt
    max_tokens = _int(parameters, "max_tokens", DEFAULT_MAX_TOKENS, low=1)
    if max_tokens > room:
        raise InvalidInputError(
            f"parameters.max_tokens is {max_tokens}; a prompt of {prompt} tokens leaves room for "
            f"{room} in a slot of {info.max_length} (max_sequence_length)"
        )
    temperature = _number(parameters, "temperature", 0.0)
    if temperature < 0:
        raise InvalidInputError(
            f"parameters.temperature is {temperature:g}; it must be 0 (greedy) or more"
        )
    top_p = _number(parameters, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidInputError(f"parameters.top_p is {top_p:g}; it must be in (0, 1]")
    top_k = _int(parameters, "top_k", 0, low=0)
    seed = parameters.get("seed")
    if seed is not None and (
        not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _SEED_LIMIT
    ):
        raise InvalidInputError(
            f"parameters.seed must be an integer from 0 to 2**63-1, got {quote(seed)}"
        )
    stops = parameters.get("stop_token_ids")
    stop_ids = (
        frozenset(info.end_token_ids)
        if stops is None
        else frozenset(check_ids(stops, "parameters.stop_token_ids", info))
    )
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return GenerationParams(max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids)


def _int(parameters: dict[str, Any], name: str, default: int, *, low: int) -> int:
    value = parameters.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidInputError(
            f"parameters.{name} must be an integer of at least {low}, got {quote(value)}"
        )
    return value


def _number(parameters: dict[str, Any], name: str, default: float) -> float:
    value = parameters.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidInputError(f"parameters.{name} must be a finite number, got {quote(value)}")
    return float(value)


def encode_generate(
    call: GenerateCall,
    done: Completion,
    name: str,
    version: str,
    tokenizer: TextTokenizer | None,
) -> bytes:
    """The answer: the completion only (not the prompt); ``text_output`` where the model has a
    tokenizer."""
    answer: dict[str, Any] = {"model_name": name, "model_version": version}
    if tokenizer is not None:
        answer["text_output"] = tokenizer.decode(done.output_ids)
    answer["output_ids"] = list(done.output_ids)
    answer["finish_reason"] = done.finish_reason
    return orjson.dumps(answer)
