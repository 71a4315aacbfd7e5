"""One replica's stages as a Ray Compiled Graph: the low-latency option (``compiled_graph``).

A plain actor call costs 1.5 to 3 ms on a small CPU machine; through a compiled graph the same
stage call costs about 0.9 ms (docs/benchmarks.md), because the graph's channels replace the
per-call task submission. The price, and why it is an option and not the default: each graph
actor spins a CPU core while it waits for input, and an actor that dies closes the graph (Ray's
actor restarts do not reattach it): ``shards.pipeline`` then rebuilds the whole replica.

The graph mirrors the plain path's routes: a stage reads the request, earlier stages, or both,
and the graph's outputs are the stages that produce model outputs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from shards.errors import ReplicaLostError
from shards.tensor_routes import Route

__all__ = ["CompiledStages"]


class CompiledStages:
    """The compiled graph of one replica. Build it inside the running event loop."""

    def __init__(
        self,
        actors: Sequence[Any],
        routes: Sequence[Route],
        output_stages: Sequence[int],
        max_inflight: int,
    ) -> None:
        from ray.dag import InputNode, MultiOutputNode

        if not output_stages:
            raise ValueError("a compiled graph needs at least one stage that produces an output")
        self.output_stages = tuple(output_stages)
        with InputNode() as request:
            nodes: list[Any] = []
            for actor, route in zip(actors, routes, strict=True):
                parts = [request] if route.needs_request else []
                parts += [nodes[j] for j in route.from_stages]
                nodes.append(actor.forward.bind(*parts))
            leaves = [nodes[s] for s in self.output_stages]
            dag = leaves[0] if len(leaves) == 1 else MultiOutputNode(leaves)
        self._graph = dag.experimental_compile(
            enable_asyncio=True, _max_inflight_executions=max_inflight
        )
        # Past its capacity the graph raises instead of queueing: extra batches wait here.
        self._places = asyncio.Semaphore(max_inflight)

    async def run(self, inputs: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        """Each output stage's outputs for one batch."""
        async with self._places:
            try:
                future = await self._graph.execute_async(inputs)
                result = await future
            except ray.exceptions.RayError:
                raise  # the model raised (RayTaskError), or the graph says why it broke
            except Exception as exc:
                # Ray 2.60 fails inside its own result cache on a closed graph (an actor died):
                # "TypeError: 'RayChannelError' object is not iterable".
                raise ReplicaLostError(
                    f"the compiled graph broke ({type(exc).__name__}); a stage actor died"
                ) from exc
            values = [result] if len(self.output_stages) == 1 else list(result)
            for value in values:
                if isinstance(value, BaseException):
                    raise value
            # The arrays are read zero-copy from the graph's shared-memory buffers, which stay
            # taken while anything holds them: with callers keeping their answers, the stages
            # stalled on a full channel. A copy frees the buffer as this returns.
            return {
                stage: {name: np.array(value, copy=True) for name, value in outputs.items()}
                for stage, outputs in zip(self.output_stages, values, strict=True)
            }

    def teardown(self) -> None:
        self._graph.teardown()
