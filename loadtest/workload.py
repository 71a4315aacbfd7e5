"""What a generation load sends: prompts and ``max_tokens`` drawn from a distribution the operator
gives (a small TOML or JSON file, or the tuner's options), and the streamed bodies made of them.

    # workload.toml
    prompt_tokens = [16, 64]   # random token ids, lengths uniform in the range (both ends in)
    vocabulary = 100           # the ids are drawn from 1 .. vocabulary - 1
    # prompts = ["Once upon a time", "The quick brown fox"]   # or these, drawn uniformly
    max_tokens = [8, 128]      # uniform in the range; or one number
    temperature = 0.0          # 0: greedy
    route = "openai"           # "openai": POST /v1/completions; "v2": .../generate_stream
    stop = true                # false (v2 only): no stop id, so every answer is max_tokens long
    seed = 0

No Locust here: the streaming user (``loadtest/generate.py``) and the tuner read it, the tests
too.
"""

from __future__ import annotations

import json
import random
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.sse import completion_body

__all__ = ["ROUTES", "Workload", "load_workload", "parse_range"]

ROUTES = ("openai", "v2")
_KEYS = {"prompt_tokens", "vocabulary", "prompts", "max_tokens", "temperature", "route", "stop"}


@dataclass(frozen=True)
class Workload:
    prompt_tokens: tuple[int, int] = (16, 64)
    vocabulary: int = 100
    prompts: tuple[str | tuple[int, ...], ...] = ()  # given prompts, drawn instead of random ids
    max_tokens: tuple[int, int] = (8, 128)
    temperature: float = 0.0
    route: str = "openai"
    stop: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.prompt_tokens
        if not 1 <= low <= high:
            raise ValueError(f"prompt_tokens needs 1 <= min <= max, got {low}..{high}")
        low, high = self.max_tokens
        if not 1 <= low <= high:
            raise ValueError(f"max_tokens needs 1 <= min <= max, got {low}..{high}")
        if self.vocabulary < 2:
            raise ValueError(f"vocabulary must be at least 2, got {self.vocabulary}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")
        if not self.stop and self.route != "v2":
            raise ValueError("stop = false needs route = 'v2' (the OpenAI routes always stop)")

    def path(self, model: str) -> str:
        if self.route == "openai":
            return "/v1/completions"
        return f"/v2/models/{model}/generate_stream"

    def describe(self) -> str:
        if self.prompts:
            prompts = f"{len(self.prompts)} given prompts"
        else:
            low, high = self.prompt_tokens
            prompts = f"prompts of {low}..{high} random ids (< {self.vocabulary})"
        low, high = self.max_tokens
        tokens = f"max_tokens {low}" if low == high else f"max_tokens {low}..{high}"
        stop = "" if self.stop else ", no stop id"
        return f"{prompts}, {tokens}, temperature {self.temperature:g}{stop} ({self.route})"

    def draw(self, n: int) -> list[tuple[str | tuple[int, ...], int]]:
        """``n`` (prompt, max_tokens) pairs, seeded."""
        rng = random.Random(self.seed)
        out: list[tuple[str | tuple[int, ...], int]] = []
        for _ in range(n):
            prompt: str | tuple[int, ...]
            if self.prompts:
                prompt = rng.choice(self.prompts)
            else:
                length = rng.randint(*self.prompt_tokens)
                prompt = tuple(rng.randrange(1, self.vocabulary) for _ in range(length))
            out.append((prompt, rng.randint(*self.max_tokens)))
        return out

    def bodies(self, n: int, model: str) -> list[bytes]:
        """``n`` streamed request bodies for the workload's route (``model``: the served name,
        the OpenAI body's ``model``; empty: the server's default)."""
        out = []
        for prompt, max_tokens in self.draw(n):
            if self.route == "openai":
                ids_or_text = prompt if isinstance(prompt, str) else list(prompt)
                body = completion_body(
                    ids_or_text, max_tokens, model or None, temperature=self.temperature
                )
            else:
                parameters: dict[str, Any] = {
                    "max_tokens": max_tokens,
                    "temperature": self.temperature,
                }
                if not self.stop:
                    parameters["stop_token_ids"] = []
                key = "text_input" if isinstance(prompt, str) else "input_ids"
                value = prompt if isinstance(prompt, str) else list(prompt)
                data = {key: value, "parameters": parameters}
                body = json.dumps(data, separators=(",", ":")).encode()
            out.append(body)
        return out


def parse_range(value: Any, name: str) -> tuple[int, int]:
    """``16`` -> (16, 16); ``[16, 64]`` or ``"16:64"`` -> (16, 64)."""
    if isinstance(value, str):
        low, sep, high = value.partition(":")
        try:
            value = [int(low), int(high)] if sep else int(low)
        except ValueError:
            raise ValueError(f"{name} wants N or MIN:MAX, got {value!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if (
        isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[1])
    raise ValueError(f"{name} wants a number or [min, max], got {value!r:.60}")


def load_workload(path: Path | None, **overrides: Any) -> Workload:
    """The workload in ``path`` (``.toml``, else JSON), then ``overrides`` that are not None."""
    data: dict[str, Any] = {}
    if path is not None:
        text = path.read_text()
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            kind = "TOML" if path.suffix == ".toml" else "JSON"
            raise ValueError(f"{path} is not valid {kind}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a table of workload keys")
        unknown = sorted(set(data) - _KEYS - {"seed"})
        if unknown:
            raise ValueError(
                f"{path}: unknown key {unknown[0]!r}; expected some of {sorted(_KEYS | {'seed'})}"
            )
    data |= {k: v for k, v in overrides.items() if v is not None}
    fields: dict[str, Any] = {}
    for key in ("prompt_tokens", "max_tokens"):
        if key in data:
            fields[key] = parse_range(data[key], key)
    if "prompts" in data:
        prompts = data["prompts"]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts wants a non-empty list of texts or of token id lists")
        fields["prompts"] = tuple(p if isinstance(p, str) else tuple(p) for p in prompts)
    if "vocabulary" in data:
        fields["vocabulary"] = int(data["vocabulary"])
    if "temperature" in data:
        fields["temperature"] = float(data["temperature"])
    if "route" in data:
        fields["route"] = str(data["route"])
    if "stop" in data:
        if not isinstance(data["stop"], bool):
            raise ValueError(f"stop wants true or false, got {data['stop']!r:.40}")
        fields["stop"] = data["stop"]
    if "seed" in data:
        fields["seed"] = int(data["seed"])
    return Workload(**fields)
