"""Where each tensor goes: one object reference per tensor, sent only to the stages that read it.

A stage returns each of its outputs as a separate return (``num_returns``), and a stage receives
exactly the tensors it reads, positionally in its ``spec.inputs`` order, each from the stage that
made it (or from the request). A skip tensor meant for stage 3 no longer rides through stage 2,
and the driver waits only on the model's outputs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shards.bundle.format import Manifest

# Source stage of a tensor that comes from the request itself rather than from a stage.
MODEL_INPUT = -1
# Source "stage" of a model output the driver joins from a split layer's parts
# (``shards.split``): the parts' outputs are awaited in its place.
DRIVER = -2


@dataclass(frozen=True)
class Source:
    """One tensor's producer: a stage and the position among its outputs, or the request."""

    stage: int
    index: int
    name: str

    @property
    def from_request(self) -> bool:
        return self.stage == MODEL_INPUT

    @property
    def by_driver(self) -> bool:
        return self.stage == DRIVER


@dataclass(frozen=True)
class Route:
    """What one stage reads (in its inputs' order) and how many tensors it returns."""

    inputs: tuple[Source, ...]
    num_returns: int

    @property
    def needs_request(self) -> bool:
        return any(s.from_request for s in self.inputs)

    @property
    def from_stages(self) -> tuple[int, ...]:
        return tuple(sorted({s.stage for s in self.inputs if not s.from_request}))


def plan_routes(manifest: Manifest) -> tuple[tuple[Route, ...], dict[str, Source]]:
    """Per stage, the producer of each input; per model output (signature order), its producer
    (``DRIVER`` for one the driver joins), then the producers of the parts the driver joins."""
    producer = {
        name: Source(MODEL_INPUT, i, name) for i, name in enumerate(manifest.signature.input_names)
    }
    routes = []
    for stage in manifest.stages:
        sources = []
        for spec in stage.inputs:
            if spec.name not in producer:
                raise ValueError(
                    f"stage {stage.index} input {spec.name!r} is produced by no earlier stage "
                    f"nor the model inputs {manifest.signature.input_names}"
                )
            sources.append(producer[spec.name])
        routes.append(Route(tuple(sources), len(stage.outputs)))
        producer.update(
            {spec.name: Source(stage.index, i, spec.name) for i, spec in enumerate(stage.outputs)}
        )
    for i, combine in enumerate(manifest.combines):
        producer.setdefault(combine.output, Source(DRIVER, i, combine.output))
    parts = [p for c in manifest.combines for p in c.parts]
    missing = [n for n in [*manifest.signature.output_names, *parts] if n not in producer]
    if missing:
        raise ValueError(f"model outputs {missing} are produced by no stage of the bundle")
    names = [*manifest.signature.output_names, *parts]
    return tuple(routes), {n: producer[n] for n in names}


def request_readers(routes: tuple[Route, ...]) -> Counter[str]:
    """How many stages read each model input (one put in the object store when more than one)."""
    return Counter(s.name for r in routes for s in r.inputs if s.from_request)


def cut_tensors(manifest: Manifest) -> dict[int, frozenset[str]]:
    """Per stage, its outputs that a later stage reads and the driver does not: the tensors that
    cross a cut only, which reduced-precision activations may cast."""
    read = {spec.name for stage in manifest.stages for spec in stage.inputs}
    model_outputs = set(manifest.signature.output_names)
    return {
        stage.index: frozenset(
            t.name for t in stage.outputs if t.name in read and t.name not in model_outputs
        )
        for stage in manifest.stages
    }
