"""What the pipeline needs to know of a split layer: which part of which layer a stage holds
(``StagePart``, written in the manifest), the stages' places in the pipeline (parts of one layer
side by side: "3.0", "3.1") and the pipeline's depth (places one after the other). Pure Python:
the server reads these from a manifest without TensorFlow."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StagePart", "pipeline_depth", "place_labels"]


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


def place_labels(parts: Sequence[StagePart | None]) -> list[str]:
    """Each stage's place in the pipeline, stages in order (``parts[i]``: the part stage i holds,
    None for a stage that is no part): parts of one group side by side ("3.0", "3.1"), every
    other stage a number of its own."""
    labels: list[str] = []
    step = 0
    group: dict[str, int] = {}
    for part in parts:
        if part is None:
            labels.append(str(step))
            step += 1
            continue
        if part.group not in group:
            group[part.group] = step
            step += 1
        labels.append(f"{group[part.group]}.{part.part}")
    return labels


def pipeline_depth(parts: Sequence[StagePart | None]) -> int:
    """Places one after the other (``place_labels``): the parts of one group count once."""
    groups = {part.group for part in parts if part is not None}
    return sum(1 for part in parts if part is None) + len(groups)
