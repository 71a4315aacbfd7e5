"""What the pipeline needs to know of a split layer: which part of which layer a stage holds
(``StagePart``, written in the manifest), the stages' places in the pipeline (parts of one layer
side by side: "3.0", "3.1"), the pipeline's depth (places one after the other) and which
stage's actor runs each stage (``hosts``: a tied table's logits part in its lookup part's actor,
the rows held once). Pure Python: the server reads these from a manifest without TensorFlow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GUEST_GROUP", "StagePart", "hosts", "pipeline_depth", "place_labels", "places"]

# The Ray concurrency group a guest stage runs in (``hosts``): beside the host stage's own
# (Ray's default group), so that batch n+1's lookup does not wait behind batch n's logits.
GUEST_GROUP = "held"


@dataclass(frozen=True)
class StagePart:
    """A stage that is one part of a split layer: which layer, how it was split (``rows``: a
    vocabulary range of a table; ``columns``: a range of output units) and its range."""

    layer: str
    kind: str
    how: str
    part: int
    parts: int
    start: int
    stop: int
    # "logits": the rows of a tied table held again for its reverse use (the logits over the
    # vocabulary, ``ReversibleEmbedding(..., reverse=True)``); None: the layer's own use.
    use: str | None = None
    # A tied table held once: the index of the stage (its lookup part k) whose actor holds these
    # rows and runs this stage too (``hosts``); None: this stage has an actor of its own.
    held_by: int | None = None

    @property
    def group(self) -> str:
        """The parts that run side by side: one layer's, one use's."""
        return self.layer if self.use is None else f"{self.layer} ({self.use})"

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagePart:
        return cls(
            layer=str(data["layer"]),
            kind=str(data["kind"]),
            how=str(data["how"]),
            part=int(data["part"]),
            parts=int(data["parts"]),
            start=int(data["start"]),
            stop=int(data["stop"]),
            use=None if data.get("use") is None else str(data["use"]),
            held_by=None if data.get("held_by") is None else int(data["held_by"]),
        )


def places(parts: Sequence[StagePart | None]) -> list[int]:
    """Each stage's place in the pipeline, stages in order (``parts[i]``: the part stage i holds,
    None for a stage that is no part): the parts of one group share a place, every other stage
    has one of its own."""
    found: list[int] = []
    step = 0
    group: dict[str, int] = {}
    for part in parts:
        if part is None:
            found.append(step)
            step += 1
            continue
        if part.group not in group:
            group[part.group] = step
            step += 1
        found.append(group[part.group])
    return found


def place_labels(parts: Sequence[StagePart | None]) -> list[str]:
    """Each stage's label: its place, and for a part its index ("3.0", "3.1")."""
    return [
        str(at) if part is None else f"{at}.{part.part}"
        for at, part in zip(places(parts), parts, strict=True)
    ]


def pipeline_depth(parts: Sequence[StagePart | None]) -> int:
    """Places one after the other (``places``): the parts of one group count once."""
    return len(set(places(parts)))


def hosts(parts: Sequence[StagePart | None]) -> list[int]:
    """Each stage's host: the index of the stage whose actor runs it (its own, or for a part
    ``held_by`` another, that one's). A host runs its own stage in Ray's default concurrency
    group and its guests in ``GUEST_GROUP``; the pipeline's places and depth are unchanged."""
    found = []
    for index, part in enumerate(parts):
        host = index if part is None or part.held_by is None else part.held_by
        if not 0 <= host < len(parts) or (host != index and _held(parts[host])):
            raise ValueError(f"stage {index} is held by stage {host}, which is not a host")
        found.append(host)
    return found


def _held(part: StagePart | None) -> bool:
    return part is not None and part.held_by is not None
