"""A generating model's settings (a keras_hub CausalLM preset, issue 39): its KV cache's slots,
its scheduler's limits and waits, its deadline. A base of ``serving.settings.config.Settings``,
so they come from the same flags, env vars and TOML keys as every other setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from serving.settings.waits import parse_wait_ms

__all__ = ["GenerationSettings", "is_inline_template"]


def is_inline_template(value: str) -> bool:
    """A ``chat_template`` that is the template itself, not a file's path."""
    return "{{" in value or "{%" in value


class GenerationSettings(BaseModel):
    kv_slots: int = Field(
        8,
        ge=1,
        le=4096,
        description="Slots of a generating model's KV cache in each replica, fixed at load: "
        "the most sequences it generates at once; the memory plan counts them.",
    )
    head_parts: int = Field(
        1,
        ge=1,
        le=64,
        description="Parts a generating model's LM head is split into by vocabulary rows, each "
        "its own actor sampling its slice (exact greedy, top-k, top-p, logprobs); only ids and a "
        "few scores per row cross. 1 = the last stage holds the head.",
    )
    max_running_sequences: int | None = Field(
        None,
        ge=1,
        description="Most sequences a generating model runs at once per replica (at most "
        "kv_slots); the others wait for a slot. Unset = kv_slots.",
    )
    max_waiting_prompts: int = Field(
        128,
        ge=1,
        description="Most prompts of a generating model waiting for a slot; past it 503 with "
        "Retry-After.",
    )
    prefill_timeout_ms: float | Literal["auto"] = Field(
        "auto",
        description="Longest wait of a generating model's oldest waiting prompt for others to "
        "join its prefill (0 = at once); auto = at once into an idle group, else at the next "
        "step, beside the running sequences.",
    )
    prefill_budget_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="Most prompt tokens of a generating model that may join one step, so that "
        "long prompts do not stall the running sequences; a longer prompt joins a step alone. "
        "Unset = no cap.",
    )
    generation_groups: int | None = Field(
        None,
        ge=1,
        le=64,
        description="Groups of sequences a generating model keeps in flight per replica, each a "
        "step behind the one ahead, so that every stage works. Unset = its stages + 1.",
    )
    generation_timeout_ms: float = Field(
        300000.0,
        gt=0,
        le=3_600_000,
        description="Deadline of a generate request (X-Request-Timeout-Ms may shorten): past "
        "it, 504. request_timeout_ms does not apply to it.",
    )

    chat_template: str | None = Field(
        None,
        description="Jinja2 chat template of a generating model for POST /v1/chat/completions "
        "(as Hugging Face's chat_template), run sandboxed: the template itself, or the path of "
        "a file holding it. Unset = the chat route answers 400 saying how to give one.",
    )

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, value: str | None) -> str | None:
        if value is None or is_inline_template(value):
            return value
        path = Path(value)
        if not path.is_file():
            raise ValueError(
                f"{value[:200]!r} is neither a Jinja2 template (no '{{{{' or '{{%' in it) nor "
                "a file"
            )
        return value

    @field_validator("prefill_timeout_ms", mode="before")
    @classmethod
    def _prefill_timeout(cls, value: Any) -> float | str:
        return parse_wait_ms(value)

    @model_validator(mode="after")
    def _running_within_slots(self) -> GenerationSettings:
        if self.max_running_sequences is not None and self.max_running_sequences > self.kv_slots:
            raise ValueError(
                f"max_running_sequences ({self.max_running_sequences}) must be at most kv_slots "
                f"({self.kv_slots}): a running sequence holds a slot"
            )
        return self
