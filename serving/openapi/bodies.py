"""The fixed bodies of the routes (TF-Serving's GETs, health, admin) as the pydantic models
they are sent through (``response_model``), and the error answers every route documents.

A key a model lacks fails the route that sends it (``extra="forbid"``): a test finds that
before the document drifts from what is sent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Alive",
    "BatchingView",
    "Body",
    "Error",
    "GenerationChange",
    "GenerationView",
    "ModelMetadata",
    "ModelStatus",
    "Readiness",
    "RunTimeView",
    "errors",
    "ok",
]

Schema = dict[str, Any]
Responses = dict[int | str, dict[str, Any]]

_RETRY_AFTER_DOC = {
    "description": "Seconds to wait before retrying (when the queue is full).",
    "schema": {"type": "integer", "minimum": 1},
}
_WHY = {
    400: "The body or a header does not fit the model signature (the message says what was "
    "sent and what is expected).",
    401: "No bearer token.",
    403: "The bearer token is not the admin token.",
    404: "No such model, version or label (the message names what is served).",
    409: "The model's state does not allow it now (no canary to promote or roll back).",
    413: "The body is over max_body_bytes.",
    422: "The model raised on this request's rows; its batch-mates got their answers.",
    500: "The model or its stage processes failed on the batch.",
    503: "The queue is full (with Retry-After), the model is loading or has no healthy "
    "replica, or the server is stopping.",
    504: "The deadline passed before the rows were computed.",
}


class Body(BaseModel):
    """A response body: a key the model lacks fails the route that sends it."""

    model_config = ConfigDict(extra="forbid")


class Error(Body):
    error: str


def ok(schema: Schema | type[BaseModel], description: str = "OK") -> Responses:
    """The 200 response of a route with a JSON body of ``schema`` (a model or a raw schema)."""
    if isinstance(schema, dict):
        return {
            200: {"description": description, "content": {"application/json": {"schema": schema}}}
        }
    return {200: {"description": description, "model": schema}}


def errors(*codes: int) -> Responses:
    docs: Responses = {}
    for code in codes:
        docs[code] = {"description": _WHY[code], "model": Error}
        if code == 503:
            docs[code]["headers"] = {"Retry-After": _RETRY_AFTER_DOC}
    return docs


class Alive(Body):
    status: Literal["alive"]


class Readiness(Body):
    status: Literal["ready", "loading", "failed", "shutting down", "unavailable"]
    model: str | None = None
    error: str | None = None


class VersionState(Body):
    error_code: Literal["OK", "UNAVAILABLE"]
    error_message: str


class Replicas(Body):
    total: int
    healthy: int


class ModelVersion(Body):
    version: str
    state: Literal["START", "LOADING", "AVAILABLE", "UNLOADING", "END"]
    status: VersionState
    replicas: Replicas | None = None


class ModelStatus(Body):
    """TF Serving's model status: every version of the model (or the one named), and the
    replicas of the version a request that names none reaches."""

    model_version_status: list[ModelVersion]
    replicas: Replicas | None = None


class TensorDoc(Body):
    name: str
    shape: list[int | None]
    dtype: str


class ModelSpec(Body):
    name: str
    version: str


class ModelMetadata(Body):
    model_spec: ModelSpec
    name: str
    inputs: list[TensorDoc]
    outputs: list[TensorDoc]
    num_stages: int
    replicas: int
    max_batch_size: int


class LengthRunTime(Body):
    """The predictions at one length bucket (ms per batch size)."""

    latency: dict[str, float | None]
    bottleneck: dict[str, float | None]


class RunTimeView(Body):
    """What the batching policy predicts per batch size (ms; null: nothing measured yet). For a
    length-padded model: at the longest length bucket measured, and ``by_length`` per bucket
    (empty for a model without a length)."""

    from_compute: bool
    hop: float | None
    latency: dict[str, float | None]
    bottleneck: dict[str, float | None]
    by_length: dict[str, LengthRunTime] = {}


class ReplicasView(Body):
    """A version's replica bounds, the count it should have and why: ``reason`` is the
    autoscaler's last (``queue_wait``, ``low_load``, ``min_replicas``, ``max_replicas``), or
    ``start``, or ``fixed`` where the runner cannot change its count; absent for a fixed count
    (``serving.version.scale_state.ScaleStatus``)."""

    min_replicas: int
    max_replicas: int
    target_replicas: int
    reason: str
    detail: str
    # What a replica the cluster has not placed yet waits for ("" when none waits).
    pending: str = ""


class GenerationView(Body):
    """A generating version's scheduler: its slots and what it runs now."""

    kv_slots: int  # per replica, fixed at load
    max_running_sequences: int  # per replica, at most kv_slots (PUT changes it)
    prefill_timeout_ms: float | Literal["auto"]  # PUT changes it
    prefill_budget_tokens: int | None  # prompt tokens per step; null: no cap (PUT changes it)
    replicas: int
    running_sequences: int
    waiting_prompts: int
    free_kv_slots: int


class GenerationChange(BaseModel):
    """Some of a generating version's run-time knobs (``serving.generation.knobs``); a field left
    out is left as it is."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_running_sequences: int | None = Field(
        None, description="sequences each replica runs at once: 1 to its kv_slots"
    )
    prefill_timeout_ms: float | Literal["auto"] | None = Field(
        None,
        description="ms from 0 to 60000 the oldest waiting prompt waits for others to join its "
        "prefill, or 'auto' (or null)",
    )
    prefill_budget_tokens: int | None = Field(
        None,
        description="prompt tokens that may join one step (a longer prompt joins alone), or "
        "null for no cap",
    )


class BatchingView(Body):
    max_batch_size: int
    batch_timeout_ms: float | Literal["auto"]
    max_inflight_batches: int
    max_queue_rows: int
    slo_p99_ms: float | None
    effective_wait_ms: float
    queued_rows: int
    inflight_batches: int
    padding: bool
    run_time_ms: RunTimeView
    replicas: ReplicasView | None = None  # null before it serves
