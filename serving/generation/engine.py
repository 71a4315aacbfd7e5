"""A served generating version's engine: its scheduler over its replicas, its tokenizer and what
the model is (``GenerationInfo``). The served version (``serving.version.served``) holds one in
place of a runner and batcher; the generate route reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from serving.generation.levels import Levels
from serving.generation.scheduler import GenerationObserver, Scheduler, SchedulerSettings
from serving.generation.sequence import GenerationParams
from serving.generation.tokenizer import TextTokenizer, load_tokenizer
from serving.settings.config import Settings
from shards.generation.contract import GenerationInfo, GenerationReplica
from shards.signature import ModelSignature, TensorSpec

__all__ = ["Generator", "scheduler_settings"]


class Generator:
    def __init__(
        self,
        replicas: Sequence[GenerationReplica],
        settings: SchedulerSettings,
        tokenizer: TextTokenizer | None = None,
        *,
        observer: GenerationObserver | None = None,
        load_tokenizer_from_info: bool = True,
    ) -> None:
        self.info: GenerationInfo = replicas[0].info
        self.replicas = len(replicas)
        if tokenizer is None and load_tokenizer_from_info:
            tokenizer = load_tokenizer(self.info)
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(replicas, settings, observer)

    @property
    def signature(self) -> ModelSignature:
        """What the V2 metadata shows of a generating model: the ids in, the ids out (the
        generate route's), each up to the slot length."""
        length = self.info.max_length
        return ModelSignature(
            name=self.info.model_family,
            inputs=(TensorSpec("input_ids", (None,), "int32", max_length=length),),
            outputs=(TensorSpec("output_ids", (None,), "int32", max_length=length),),
        )

    def gauges(
        self,
    ) -> tuple[Callable[[], float], Callable[[], float], dict[str, Callable[[], float]]]:
        """What the metrics' gauges read: the running sequences, the free slots, and each
        priority level's waiting prompts."""
        scheduler = self.scheduler
        waiting: dict[str, Callable[[], float]] = {
            level: partial(scheduler.waiting_at, level) for level in scheduler.levels.names
        }
        return (lambda: float(scheduler.running)), (lambda: float(scheduler.free_slots)), waiting

    def start(self) -> None:
        self.scheduler.start()

    def set_observer(self, observer: GenerationObserver) -> None:
        self.scheduler.observer = observer

    def check_headroom(self, priority: str | None = None) -> None:
        """Refuse (503 with Retry-After) when the prompt queue of level ``priority`` is full
        (``None``: of every level), from the headers."""
        self.scheduler.check_headroom(priority)

    async def warm_up(self) -> None:
        """One token end to end, so that the first prompt does not pay for the set-up."""
        first = self.info.start_token_id if self.info.start_token_id is not None else 0
        await self.scheduler.generate([first], GenerationParams(max_tokens=1))

    async def close(self, reason: str = "the model is stopping") -> None:
        await self.scheduler.close(reason)


def scheduler_settings(settings: Settings) -> SchedulerSettings:
    """The scheduler's settings from the server's (``prefill_timeout_ms``: auto or fixed, the
    batcher's two policies for prompts)."""
    return SchedulerSettings(
        max_running_sequences=settings.max_running_sequences,
        prefill_timeout_ms=None
        if settings.prefill_timeout_ms == "auto"
        else float(settings.prefill_timeout_ms),
        prefill_budget_tokens=settings.prefill_budget_tokens,
        max_waiting=settings.max_waiting_prompts,
        groups=settings.generation_groups,
        levels=Levels(tuple(settings.priority_levels), settings.default_priority),
        max_preemptions=settings.max_preemptions,
    )
