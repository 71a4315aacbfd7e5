"""What a route needs of a served model, and how it finds one by name.

The routes (``serving.http``, ``serving.protocols``) know a model only through these types, so
that they import nothing of the server that holds it (``serving.server``, a layer above them)
and a test can hand them a fake. The server's served model satisfies ``ModelHandle``; the
server's state satisfies ``ModelDirectory``, kept on the app as ``app.state.shardserve``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.config import Settings
    from shards.signature import ModelSignature

__all__ = ["ModelDirectory", "ModelHandle", "RequestMetrics", "served_models"]


class RequestMetrics(Protocol):
    """The per-request metrics a route keeps."""

    def reject(self, reason: str) -> None:
        """One more request refused or failed for ``reason`` (``queue_full``,
        ``invalid_input``, ``client_gone``)."""

    def observe_latency(self, status: int, seconds: float) -> None:
        """A request answered with ``status`` after ``seconds``."""


class ModelHandle(Protocol):
    """One served model (name and version) as the routes use it.

    - ``name``, ``version``: what it is served as (``version`` is ``"1"`` while one is served).
    - ``settings``: the server's settings (body limit, request timeout, start-up batching).
    - ``metrics``: where its requests are counted.
    - ``batcher``: its batcher once loaded, else ``None``; its ``policy`` is the live one.
    - ``signature``: its inputs and outputs; ``NotReadyError`` while it loads.
    - ``require_batcher()``: its batcher if it takes requests now, else ``NotReadyError``
      saying why (loading, failed to load, stopping, its batch loop failed).
    - ``not_ready_reason()``: why it would refuse a request now, or ``None`` when ready.
    - ``length_padding_parameters()``: the length padding in force (padded inputs, buckets,
      outputs cut back) or why it is off; ``None`` before warm-up or with no unknown length.
    """

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> RequestMetrics: ...

    @property
    def batcher(self) -> Batcher | None: ...

    @property
    def signature(self) -> ModelSignature: ...

    def require_batcher(self) -> Batcher: ...

    def not_ready_reason(self) -> str | None: ...

    def length_padding_parameters(self) -> dict[str, Any] | None: ...


class ModelDirectory(Protocol):
    """The models a server serves, by name."""

    def model(self, name: str, version: str | None = None) -> ModelHandle:
        """The model served as ``name`` (and ``version``, when given), or ``NotFoundError``
        naming what is served."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why the server as a whole is not ready (V2's ``/v2/health/ready``), or ``None``."""
        ...


def served_models(app: Any) -> ModelDirectory:
    """The directory of an app the lifespan has started (``app.state.shardserve``)."""
    directory: ModelDirectory = app.state.shardserve
    return directory
