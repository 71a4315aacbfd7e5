"""What a gRPC call and connection may hold, and for how long (``serving.protocols.grpc_limits``
applies them): the calls served, the streams, all open calls, a connection's idle time and age.
A base of ``serving.settings.config.Settings`` (same flags, env vars and TOML keys as every other
setting); the message's read deadline is ``body_read_timeout_s``, HTTP's.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

__all__ = ["GrpcSettings"]


class GrpcSettings(BaseModel):
    grpc_max_concurrent_rpcs: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="gRPC calls served at once (their message read; streams apart); one more "
        "is refused with RESOURCE_EXHAUSTED.",
    )
    grpc_max_streams: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="gRPC streams open at once (Health.Watch, server reflection), apart from "
        "grpc_max_concurrent_rpcs; one more is refused with RESOURCE_EXHAUSTED.",
    )
    grpc_max_open_calls: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="gRPC calls open at once, whatever they wait for (their message, which has "
        "body_read_timeout_s to come, the model, a stream); one more is refused with "
        "RESOURCE_EXHAUSTED before anything is read.",
    )
    grpc_max_connection_idle_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="A gRPC connection without a call for this long is closed (GOAWAY; "
        "clients reconnect when they need to).",
    )
    grpc_max_connection_age_s: float | None = Field(
        3600.0,
        gt=0,
        le=30 * 86_400,
        description="A gRPC connection is closed after this long (GOAWAY), its calls in "
        "progress given request_timeout_ms to end, streams then cut; unset = never.",
    )

    @model_validator(mode="after")
    def _open_holds_served(self) -> GrpcSettings:
        if self.grpc_max_open_calls < self.grpc_max_concurrent_rpcs:
            raise ValueError(
                f"grpc_max_open_calls ({self.grpc_max_open_calls}) must be >= "
                f"grpc_max_concurrent_rpcs ({self.grpc_max_concurrent_rpcs}): the calls served "
                "are among those open"
            )
        return self
