"""What the pipeline needs to know of a split layer: which part of which layer a stage holds
(``StagePart``, written in the manifest), the stages' places in the pipeline (parts of one layer
side by side: "3.0", "3.1") and the pipeline's depth (places one after the other). Pure Python:
the server reads these from a manifest without TensorFlow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StagePart", "pipeline_depth", "place_labels", "places"]


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
