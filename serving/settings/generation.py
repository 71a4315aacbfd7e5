"""A generating model's settings (a keras_hub CausalLM preset, issue 39): its KV cache's slots,
its scheduler's limits and waits, its deadline. A base of ``serving.settings.config.Settings``,
so they come from the same flags, env vars and TOML keys as every other setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from serving.settings.sources import split_csv
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
        description="Most prompts of a generating model waiting for a slot, per priority "
        "level; past it 503 with Retry-After (a full low level never refuses a high prompt).",
    )
    priority_levels: Annotated[list[str], NoDecode] = Field(
        ["high", "low"],
        min_length=1,
        max_length=16,
        description="Priority levels of a generating model's prompts, highest first: a request "
        "names one in its priority field or X-Priority header; a higher level's prompt starts "
        "first and may preempt a lower one's sequence when every slot is taken.",
    )
    default_priority: str = Field(
        "low",
        description="Priority level of a generate request that names none (one of "
        "priority_levels).",
    )
    max_preemptions: int = Field(
        2,
        ge=0,
        le=1000,
        description="Most times one generating sequence gives its slot to a higher-priority "
        "prompt (prefilled again from its tokens so far when a slot frees); 0 = never preempt.",
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

    @field_validator("priority_levels", mode="before")
    @classmethod
    def _levels_csv(cls, value: Any) -> Any:
        return split_csv(value)

    @field_validator("priority_levels")
    @classmethod
    def _levels(cls, value: list[str]) -> list[str]:
        for name in value:
            if not name or len(name) > 32 or not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(
                    f"priority level {name[:40]!r}: a name of letters, digits, - and _ (at most 32)"
                )
        if len(set(value)) != len(value):
            raise ValueError(f"priority levels must differ, got {value}")
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
        if self.default_priority not in self.priority_levels:
            raise ValueError(
                f"default_priority {self.default_priority[:40]!r} is not one of priority_levels "
                f"{self.priority_levels}"
            )
        return self
