"""The elastic replica settings: how many replicas a model version may have (``min_replicas``,
``max_replicas``) and when the autoscaler (``serving.elastic.policy``) changes the count. A base
of ``serving.settings.config.Settings``, so they come from the same flags, env vars and TOML
keys as every other setting, and per model from its ``config.toml``.

``replicas`` is the count a version starts at; alone it is also its minimum and maximum (a fixed
count, as before). With ``min_replicas``/``max_replicas`` a version starts at its minimum (or at
``replicas`` when given, which must then lie within the bounds) and follows its load between them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, model_validator

__all__ = ["ScalingSettings"]

_REPLICA_CEILING = 64  # Settings.replicas' own bound


class ScalingSettings(BaseModel):
    min_replicas: int | None = Field(
        None,
        ge=1,
        le=_REPLICA_CEILING,
        description="Fewest replicas of a model version (scale down to it when idle); unset = "
        "--replicas, or 1 when --max-replicas is set.",
    )
    max_replicas: int | None = Field(
        None,
        ge=1,
        le=_REPLICA_CEILING,
        description="Most replicas of a model version (scale up to it under load; a private "
        "local Ray reserves CPUs for it); unset = --min-replicas or --replicas.",
    )
    target_queue_wait_ms: float = Field(
        50.0,
        gt=0,
        le=600_000,
        description="Scale up when the queue's oldest row waits longer than this (beyond the "
        "batch wait) for --upscale-delay-s; down when the replicas left would stay under half.",
    )
    upscale_delay_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="How long the queue's wait stays over target before a replica is added.",
    )
    downscale_delay_s: float = Field(
        60.0,
        ge=0,
        le=86_400,
        description="How long the load stays under half of what one replica fewer delivers "
        "before a replica is removed.",
    )
    drain_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a replica being removed answers its in-flight batches; then its "
        "actors are killed and those batches retried on another replica (or 503).",
    )
    replica_pending_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Longest a new replica waits for its placement (resources, a node booting) "
        "before it is given up and tried again later.",
    )

    if TYPE_CHECKING:  # a field of Settings, which this is a base of
        replicas: int

    @model_validator(mode="after")
    def _replica_bounds(self) -> ScalingSettings:
        low, high = self.min_replicas, self.max_replicas
        if low is None and high is None:
            return self
        given = "replicas" in self.model_fields_set
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"min_replicas ({low}) is above max_replicas ({high}); give min <= max"
            )
        if low is None:
            low = min(self.replicas if given else 1, high if high is not None else _REPLICA_CEILING)
        high = high if high is not None else max(low, self.replicas if given else low)
        if given and not low <= self.replicas <= high:
            raise ValueError(
                f"replicas ({self.replicas}) is outside min_replicas..max_replicas "
                f"({low}..{high}); --replicas N alone is a fixed count (min = max = N): for an "
                "elastic count give only --min-replicas and --max-replicas"
            )
        if not given:
            self.replicas = low  # a version starts at its minimum
        # Both kept: a version's settings copied with another start count (a version switch,
        # a model's config.toml over the server's) keep their bounds.
        self.min_replicas, self.max_replicas = low, high
        return self

    def replica_bounds(self) -> tuple[int, int]:
        """(fewest, most) replicas of a version; equal for a fixed count."""
        if self.min_replicas is None or self.max_replicas is None:
            return self.replicas, self.replicas
        return self.min_replicas, self.max_replicas

    @property
    def elastic(self) -> bool:
        low, high = self.replica_bounds()
        return low < high
