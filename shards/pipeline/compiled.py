"""One replica's stages as a Ray Compiled Graph: the low-latency option (``compiled_graph``).

A plain actor call costs 1.5 to 3 ms on a small CPU machine; through a compiled graph the same
stage call costs about 0.9 ms (docs/benchmarks.md), because the graph's channels replace the
per-call task submission. The price, and why it is an option and not the default: each graph
actor spins a CPU core while it waits for input, and an actor that dies closes the graph (Ray's
actor restarts do not reattach it): ``shards.pipeline.replica_set`` then rebuilds the whole replica.

The graph mirrors the plain path's routes tensor by tensor: each stage method returns its
outputs as separate graph outputs (``num_returns``), a stage binds exactly the tensors it reads
(request tensors are the graph input's keyword arguments), and the graph's outputs are the model
outputs only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import ray

from shards.bundle.tensor_routes import Route, Source
from shards.errors import ReplicaLostError

__all__ = ["CompiledStages"]


class CompiledStages:
    """The compiled graph of one replica. Build it inside the running event loop."""

    def __init__(
        self,
        actors: Sequence[Any],
        routes: Sequence[Route],
        outputs: dict[str, Source],
        max_inflight: int,
        hosts: Sequence[int] = (),
    ) -> None:
        from ray.dag import InputNode, MultiOutputNode

        if not outputs:
            raise ValueError("a compiled graph needs at least one stage that produces an output")
        self.output_names = tuple(outputs)
        with InputNode() as request:
            made: list[list[Any]] = []
            for stage, (actor, route) in enumerate(zip(actors, routes, strict=True)):
                args = [
                    request[s.name] if s.from_request else made[s.stage][s.index]
                    for s in route.inputs
                ]
                # A guest stage (a tied table held once) is named to its host's actor. The graph
                # runs an actor's calls one after the other, in order: held once, a compiled
                # replica does not overlap a host's lookups with its logits.
                named = {"stage": stage} if hosts and hosts[stage] != stage else {}
                # bind with num_returns > 1 gives one node per return.
                node = actor.forward.options(num_returns=route.num_returns).bind(*args, **named)
                made.append([node] if route.num_returns == 1 else list(node))
            leaves = [made[s.stage][s.index] for s in outputs.values()]
            dag = leaves[0] if len(leaves) == 1 else MultiOutputNode(leaves)
        self._graph = dag.experimental_compile(
            enable_asyncio=True, _max_inflight_executions=max_inflight
        )
        # Past its capacity the graph raises instead of queueing: extra batches wait here.
        self._places = asyncio.Semaphore(max_inflight)

    async def run(
        self, inputs: dict[str, np.ndarray], entered: Callable[[], object] | None = None
    ) -> dict[str, np.ndarray]:
        """The model outputs that stages make, for one batch. ``entered`` is called when the
        batch is handed to the graph, past the wait for a free place."""
        async with self._places:
            if entered is not None:
                entered()
            try:
                future = await self._graph.execute_async(**inputs)
                # Several outputs (a MultiOutputNode): Ray 2.60 gives one future per output.
                if isinstance(future, list):
                    result: Any = [await f for f in future]
                else:
                    result = await future
            except ray.exceptions.RayError:
                raise  # the model raised (RayTaskError), or the graph says why it broke
            except Exception as exc:
                # Ray 2.60 fails inside its own result cache on a closed graph (an actor died):
                # "TypeError: 'RayChannelError' object is not iterable".
                raise ReplicaLostError(
                    f"the compiled graph broke ({type(exc).__name__}); a stage actor died"
                ) from exc
            values = [result] if len(self.output_names) == 1 else list(result)
            for value in values:
                if isinstance(value, BaseException):
                    raise value
            # The arrays are read zero-copy from the graph's shared-memory buffers, which stay
            # taken while anything holds them: with callers keeping their answers, the stages
            # stalled on a full channel. A copy frees the buffer as this returns.
            return {
                name: np.array(value, copy=True)
                for name, value in zip(self.output_names, values, strict=True)
            }

    def teardown(self) -> None:
        self._graph.teardown()
