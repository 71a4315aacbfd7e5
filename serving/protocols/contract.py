"""The data plane's contract: what a protocol needs of a served model, and how it finds one.

The protocols (``serving.protocols``: the data plane, V2, TF Serving, OpenAI, over HTTP and
gRPC) know a model only through these types, so that they import nothing of the server that
holds it (``serving.server``, a layer above them) and a test can hand them a fake. The server's
served model satisfies ``ModelHandle``; the server's state satisfies ``ModelDirectory``, kept on
the app as ``app.state.shardserve``; its repository manager satisfies
``RepositoryControl`` (the repository API's load, unload, index).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypedDict

if TYPE_CHECKING:
    from serving.batching.batcher import Batcher
    from serving.generation.engine import Generator
    from serving.settings.config import Settings
    from serving.version.admitted import Admitted
    from serving.version.condition import Condition
    from serving.version.life import IndexState, Phase, VersionState
    from shards.signature import ModelSignature

__all__ = [
    "IndexEntry",
    "ModelDirectory",
    "ModelHandle",
    "RepositoryControl",
    "RequestMetrics",
    "served_models",
    "served_repository",
]


class RequestMetrics(Protocol):
    """The per-request metrics a route keeps."""

    def reject(self, reason: str) -> None:
        """One more request refused or failed for ``reason`` (``queue_full``,
        ``invalid_input``, ``client_gone``)."""

    def observe_latency(self, status: int, seconds: float, trace_id: str | None = None) -> None:
        """A request answered with ``status`` after ``seconds``; ``trace_id``: its sampled
        trace (passed only where there is one), the latency bucket's exemplar."""

    def observe_routed(self, failed: bool, seconds: float) -> None:
        """A request whose version the server chose (it named none, nor a label) answered
        after ``seconds``; ``failed``: the version failed it. Passed only where the version
        is to blame either way (``serving.canary.blame``): a canary's judge counts these."""


class ModelHandle(Protocol):
    """One served model (name and version) as the routes use it.

    - ``name``, ``version``: what it is served as (``version``: ``"1"`` under ``--model``).
    - ``settings``: its own settings (the server's, with its ``config.toml`` over them in a
      repository): body limit, request timeout, start-up batching.
    - ``metrics``: where its requests are counted.
    - ``batcher``: its batcher once loaded, else ``None``; its ``policy`` is the live one.
    - ``signature``: its inputs and outputs; ``NotReadyError`` while it loads.
    - ``admitted``: the requests it admitted and has not answered (its drain waits for them).
    - ``require_batcher()``: its batcher if it takes requests now, else ``NotReadyError``
      saying why (loading, failed to load, stopping, its batch loop failed).
    - ``not_ready_reason()``: why it would refuse a request now, or ``None`` when ready;
      ``available``: it takes a request now (``not_ready_reason()`` is ``None``).
    - ``length_padding_parameters()``: the length padding in force (padded inputs, buckets,
      outputs cut back) or why it is off; ``None`` before warm-up or with no unknown length.
    - ``scaling_parameters()``: its replica bounds, the count it should have and why (the
      autoscaler's last reason); ``None`` before it serves or with a fixed count.
    - ``state``, ``reason``, ``phase``, ``condition()``: its state machine's state, why it is
      there, where it stands for a request (loading, ready, stopping, failed), and how a READY
      version serves now (the status routes and calls: ``serving.protocols.tfserving.status``).
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

    @property
    def admitted(self) -> Admitted: ...

    def require_batcher(self) -> Batcher: ...

    def require_generator(self) -> Generator:
        """Its generator (a generating version's scheduler and tokenizer) if it takes a
        generate request now; else ``NotReadyError`` saying why, or ``NotFoundError`` for a
        version that does not generate (it has no generate route)."""
        ...

    def not_ready_reason(self) -> str | None: ...

    @property
    def available(self) -> bool: ...

    def length_padding_parameters(self) -> dict[str, Any] | None: ...

    def scaling_parameters(self) -> dict[str, Any] | None: ...

    @property
    def state(self) -> VersionState: ...

    @property
    def reason(self) -> str | None: ...

    @property
    def phase(self) -> Phase: ...

    def condition(self) -> Condition: ...


class ModelDirectory(Protocol):
    """The models a server serves, by name, version and label."""

    def model(
        self,
        name: str | None = None,
        version: str | None = None,
        label: str | None = None,
        *,
        split: bool = True,
    ) -> ModelHandle:
        """The version ``version`` (or the one ``label`` points at) of the model ``name``.

        ``name=None``: the default model (``/predict``'s: ``--default-model``, else the only
        one; with several and no default, ``InvalidInputError`` listing them). ``version=None``
        and no label: its rollout's pick (stable or canary, by weight; ``split=False``: a look
        that takes no turn of the split), else the model's highest READY version, else its
        highest. An unknown model, version or label: ``NotFoundError`` naming what exists."""
        ...

    def versions(self, name: str) -> list[str]:
        """The versions of the model ``name`` served now, oldest first (V2 metadata's
        ``versions``); empty for a model not served."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why the server as a whole is not ready (V2's ``/v2/health/ready``), or ``None``:
        ready once no version is still loading and at least one is READY."""
        ...

    @property
    def available(self) -> bool:
        """The server as a whole is ready (``not_ready_reason()`` is ``None``)."""
        ...


class IndexEntry(TypedDict):
    """One (model, version) of the repository index; ``version`` is ``""`` for a model with no
    complete version on disk, ``reason`` one line (``""`` when READY)."""

    name: str
    version: str
    state: IndexState
    reason: str


class RepositoryControl(Protocol):
    """The repository API (V2's model repository extension) as the routes call it."""

    def index(self, ready_only: bool = False) -> list[IndexEntry]:
        """Every (model, version) known on disk or served, sorted by name then version."""
        ...

    async def load(self, name: str) -> None:
        """Read the model's directory again and serve what its version policy selects (clearing
        a hold left by ``unload``); returns once those versions are loaded. ``NotFoundError``
        for a name not in the repository, ``InvalidInputError`` for a broken ``config.toml``,
        ``NotReadyError`` naming a version that failed to load."""
        ...

    async def unload(self, name: str) -> None:
        """Stop serving every version of the model: each answers what it holds, then its actors
        end. Polling leaves the model unloaded until a ``load``. ``NotFoundError`` for a name
        neither served nor in the repository."""
        ...


def served_models(app: Any) -> ModelDirectory:
    """The directory of an app the lifespan has started (``app.state.shardserve``)."""
    directory: ModelDirectory = app.state.shardserve
    return directory


def served_repository(app: Any) -> RepositoryControl:
    """The repository manager of an app the lifespan has started."""
    control: RepositoryControl = app.state.shardserve.repository
    return control
