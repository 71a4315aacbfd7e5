"""The standard gRPC health service (``grpc.health.v1.Health``) on the gRPC port, answered from
the served versions' readiness rather than from statuses someone must remember to set.

    ""                                  the server: SERVING once it is ready (V2's ready)
    a service on the port               the same (``inference.GRPCInferenceService``,
                                        ``tensorflow.serving.PredictionService``, ...)
    "<model>"                           the version a call naming no version reaches
    "<model>/<version>"                 that version
    anything else                       NOT_FOUND (Check), SERVICE_UNKNOWN (Watch)

A model is SERVING when it takes requests now (``available``): loading,
draining, failed or with no healthy replica, NOT_SERVING. ``Watch`` sends the status, then each
change; no event spans every version's state (versions come and go with the repository), so it
looks again every ``WATCH_INTERVAL_S``, which costs a dictionary look-up per open stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.errors import ShardServeError
from serving.protocols.contract import ModelDirectory
from serving.quoting import quote

__all__ = ["HEALTH_SERVICE", "WATCH_INTERVAL_S", "ServedHealth"]

HEALTH_SERVICE = "grpc.health.v1.Health"
WATCH_INTERVAL_S = 1.0
_Status = health_pb2.HealthCheckResponse
_SERVING, _NOT_SERVING, _UNKNOWN = _Status.SERVING, _Status.NOT_SERVING, _Status.SERVICE_UNKNOWN


class ServedHealth(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` for ``models``, and for ``services`` (the port's services)."""

    def __init__(self, models: ModelDirectory, services: Iterable[str]) -> None:
        self._models = models
        self._services = frozenset(services)

    def status(self, service: str) -> Any:
        """The service's status now; ``None`` for a name that is neither a service on the
        port nor a served model (or version)."""
        if service == "" or service in self._services:
            return _SERVING if self._models.available else _NOT_SERVING
        name, _, version = service.partition("/")
        try:
            model = self._models.model(name, version or None, split=False)
        except ShardServeError:
            return None
        return _SERVING if model.available else _NOT_SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.status(request.service)
        if status is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown service {quote(request.service)}: ask for '' (the server), a service on "
                "this port, a model's name, or '<model>/<version>'",
            )
        return _Status(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        last = None
        while True:
            status = self.status(request.service)
            status = _UNKNOWN if status is None else status
            if status != last:
                yield _Status(status=status)
                last = status
            await asyncio.sleep(WATCH_INTERVAL_S)
