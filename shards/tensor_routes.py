"""Where each stage's inputs come from: the request itself and/or earlier stages.

A stage may read a model input directly (an attention mask that only a late stage needs), so
the request is routed past the stages that do not read it rather than through them.
"""

from __future__ import annotations

from dataclasses import dataclass

from shards.bundle import Manifest

# Source index of a tensor that comes from the request itself rather than from a stage.
MODEL_INPUT = -1


@dataclass(frozen=True)
class Route:
    """Where one stage's inputs come from: the request and/or earlier stages."""

    needs_request: bool
    from_stages: tuple[int, ...]


def plan_routes(manifest: Manifest) -> tuple[tuple[Route, ...], dict[str, int]]:
    """Per stage, its input sources; per model output (signature order), its producer."""
    producer = {name: MODEL_INPUT for name in manifest.signature.input_names}
    routes = []
    for stage in manifest.stages:
        sources = set()
        for spec in stage.inputs:
            if spec.name not in producer:
                raise ValueError(
                    f"stage {stage.index} input {spec.name!r} is produced by no earlier stage "
                    f"nor the model inputs {manifest.signature.input_names}"
                )
            sources.add(producer[spec.name])
        routes.append(Route(MODEL_INPUT in sources, tuple(sorted(sources - {MODEL_INPUT}))))
        producer.update({spec.name: stage.index for spec in stage.outputs})
    missing = [n for n in manifest.signature.output_names if n not in producer]
    if missing:
        raise ValueError(f"model outputs {missing} are produced by no stage of the bundle")
    return tuple(routes), {n: producer[n] for n in manifest.signature.output_names}
