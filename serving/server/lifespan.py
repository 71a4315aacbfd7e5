"""The app's lifespan, which owns every resource: it makes the server's state (its registry of
what it serves) and the repository manager with its reconciler (``app.state.repository``, for
the routes that need it), starts gRPC and the repository (every version its policies select
loads in the background), and at the end stops them within the stop budget: the reconciler
first, then every served version drained and closed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI

from serving.protocols.grpc_port import start_grpc_server, stop_grpc_server
from serving.server.state import ServerState
from serving.settings.config import Settings
from serving.telemetry import setup as telemetry
from serving.version.runner import release_cluster

if TYPE_CHECKING:
    import grpc

    from serving.repository.manager import Repository

log = logging.getLogger("shardserve")

Lifespan = Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]


def make_lifespan(
    settings: Settings, repository_of: Callable[[ServerState], Repository]
) -> Lifespan:
    """``repository_of`` makes the state's repository manager (``serving.repository.manager``;
    the app passes it, which keeps this module's imports short)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        telemetry.start(settings)  # before Ray starts: its workers get the OTEL_* variables
        state = ServerState(settings=settings)
        repository = repository_of(state)
        app.state.shardserve = state
        # The routes that need the manager (the repository API, the canary's admin routes)
        # find it here; the registry holds a reference only for the repository API's routes.
        app.state.repository = state.repository = repository
        # None when grpc_port is 0.
        grpc_server = await start_grpc_server(state, settings, lambda: repository)
        try:
            await repository.start()
            yield
        finally:
            try:
                await _shut_down(state, repository, grpc_server)
            finally:
                telemetry.stop()

    return lifespan


async def _shut_down(
    state: ServerState, repository: Repository, grpc_server: grpc.aio.Server | None
) -> None:
    """Every step within what is left of the stop budget (``serving.version.stop_budget``): after
    a SIGTERM the graceful server has drained the served versions already, out of the same
    budget."""
    budget = state.begin_stop()
    await repository.stop(budget.answer_left())  # no step starts or unloads a version now
    models = state.served()
    await asyncio.gather(*(model.stop_jobs(budget.answer_left()) for model in models))
    # gRPC keeps serving meanwhile: its calls held in the batchers get their answers.
    await state.drain(budget)
    await stop_grpc_server(grpc_server, grace_s=budget.answer_left())
    await asyncio.gather(*(model.close(budget.left()) for model in models))
    await release_cluster(budget.left())
