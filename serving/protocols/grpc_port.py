"""The gRPC port: one ``grpc.aio`` server in the HTTP server's process and event loop (the
lifespan starts and stops it), several services on it.

- ``inference.GRPCInferenceService``: the Open Inference Protocol (``serving.protocols.v2``).
- ``tensorflow.serving.PredictionService`` and ``tensorflow.serving.ModelService``: TensorFlow
  Serving's gRPC API (``serving.protocols.tfserving``), so that a TF Serving client switches by
  changing only the address.
- ``grpc.health.v1.Health``: per service and per model (``serving.protocols.grpc_health``).
- ``grpc.reflection.v1alpha.ServerReflection``: ``grpcurl list`` and ``describe`` work. Each
  protocol's messages live in a descriptor pool of its own (they clash with the client libraries'
  in the default pool), so reflection reads a pool of its own that holds a copy of every file.

Every service shares the server's limits: ``max_body_bytes`` for a message (RESOURCE_EXHAUSTED
before it is decoded), and what a call may hold and for how long (``grpc_limits``: the calls
served, the streams, the message's read, the connections' keepalive, idle time and age).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from serving.protocols.contract import ModelDirectory
from serving.protocols.grpc_health import HEALTH_SERVICE, ServedHealth
from serving.protocols.grpc_limits import CallLimits, server_options
from serving.protocols.tfserving.grpc_service import add_tfserving_services
from serving.protocols.tfserving.proto import model_service_pb2, prediction_service_pb2
from serving.protocols.v2.grpc_repository import ADMIN_METHODS, ADMIN_WHAT, RepositorySource
from serving.protocols.v2.grpc_server import add_v2_service
from serving.protocols.v2.proto import grpc_service_pb2

if TYPE_CHECKING:
    from serving.settings.config import Settings

__all__ = ["reflection_pool", "start_grpc_server", "stop_grpc_server"]

log = logging.getLogger("shardserve")


def _no_repository() -> None:
    return None


async def start_grpc_server(
    models: ModelDirectory,
    settings: Settings,
    repository: RepositorySource = _no_repository,
    limits: CallLimits | None = None,
) -> grpc.aio.Server | None:
    """Serve gRPC on ``settings.grpc_port`` in the running event loop (``None`` when it is 0);
    ``repository`` gives the repository control V2's repository calls use, once there is one;
    ``limits``: the calls' counts and caps (made from ``settings`` by default)."""
    if not settings.grpc_port:
        return None
    server = grpc.aio.server(
        # What each call holds, counted and capped (grpc_limits); past all of them together
        # one more call is refused at once (RESOURCE_EXHAUSTED), before its message is read.
        interceptors=[limits or CallLimits(settings, ADMIN_METHODS, ADMIN_WHAT)],
        maximum_concurrent_rpcs=settings.grpc_max_open_calls,
        options=[
            # The body cap of HTTP: a bigger message is refused before it is decoded.
            ("grpc.max_receive_message_length", settings.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            # gRPC shares a busy port by default (SO_REUSEPORT): make it an error instead.
            ("grpc.so_reuseport", 0),
            *server_options(settings),
        ],
    )
    services = [
        add_v2_service(server, models, settings, repository),
        *add_tfserving_services(server, models),
    ]
    health_pb2_grpc.add_HealthServicer_to_server(ServedHealth(models, services), server)  # type: ignore[no-untyped-call]
    services.append(HEALTH_SERVICE)
    services.append(reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server, pool=_reflection_pool())
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        if settings.tls:
            server.add_secure_port(address, _credentials(settings))
        else:
            server.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(
            f"cannot serve gRPC on {address}: the port is in use or not allowed; "
            "choose another with --grpc-port, or 0 to turn gRPC off"
        ) from None
    await server.start()
    tls = "" if not settings.tls else " (mutual TLS)" if settings.tls_ca_file else " (TLS)"
    log.info("gRPC (Open Inference Protocol, TensorFlow Serving) on %s%s", address, tls)
    return server


def _credentials(settings: Settings) -> grpc.ServerCredentials:
    """The server's certificate and key, and with ``tls_ca_file`` the CA its clients'
    certificates must be signed by (checked when the settings were read)."""
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    ca = settings.tls_ca_file
    return grpc.ssl_server_credentials(
        [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
        root_certificates=None if ca is None else ca.read_bytes(),
        require_client_auth=ca is not None,
    )


async def stop_grpc_server(server: grpc.aio.Server | None, *, grace_s: float) -> None:
    """New calls are refused at once; calls still open get ``grace_s`` (what is left of the
    stop budget's answer phase: their rows were answered or failed by then) to finish."""
    if server is not None:
        await server.stop(grace_s)


def reflection_pool(files: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    """A pool holding ``files`` and every file they import, each once, imports first (the
    pools they come from may each hold its own copy of a well-known type)."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    for file in files:
        add(file)
    return pool


def _reflection_pool() -> descriptor_pool.DescriptorPool:
    return reflection_pool(
        (
            grpc_service_pb2.DESCRIPTOR,
            prediction_service_pb2.DESCRIPTOR,
            model_service_pb2.DESCRIPTOR,
            health_pb2.DESCRIPTOR,
            reflection_pb2.DESCRIPTOR,
        )
    )
