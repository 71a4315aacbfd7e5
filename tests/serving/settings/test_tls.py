"""TLS on both ports (issue 37, item 10), with certificates the test makes: HTTPS and gRPC over
TLS with ``tls_cert_file``/``tls_key_file``, mutual TLS with ``tls_ca_file``, and files that do
not fit refused when the settings are read."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.protocols.grpc_port import start_grpc_server, stop_grpc_server
from serving.server.state import ServerState
from serving.settings.config import ConfigError, Settings, load_settings
from tests.serverproc import free_ports
from tests.serving.http.uvicorn_server import running
from tests.tls_certs import TlsFiles, make_tls_files


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def client_context(tls: TlsFiles, *, with_certificate: bool) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(tls.ca))
    if with_certificate:
        context.load_cert_chain(str(tls.client_cert), str(tls.client_key))
    return context


async def test_https_with_the_certificate_and_no_clear_text(tls: TlsFiles) -> None:
    context = client_context(tls, with_certificate=False)
    async with running(client_tls=context, tls_cert_file=tls.cert, tls_key_file=tls.key) as s:
        ok = await s.client.get("/healthz")
        port = s.client.base_url.port
        async with httpx.AsyncClient(timeout=10) as plain:
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{port}/healthz")
    assert str(s.client.base_url).startswith("https://")
    assert ok.status_code == 200


async def test_mutual_tls_wants_a_certificate_the_ca_signed(tls: TlsFiles) -> None:
    files = {"tls_cert_file": tls.cert, "tls_key_file": tls.key, "tls_ca_file": tls.ca}
    context = client_context(tls, with_certificate=True)
    async with running(client_tls=context, **files) as s:
        ok = await s.client.get("/healthz")
        anonymous = client_context(tls, with_certificate=False)
        async with httpx.AsyncClient(verify=anonymous, timeout=10) as other:
            with pytest.raises(httpx.HTTPError):
                await other.get(f"https://127.0.0.1:{s.client.base_url.port}/healthz")
    assert ok.status_code == 200


@contextlib.asynccontextmanager
async def grpc_server(**overrides: Any) -> AsyncIterator[str]:
    (port,) = free_ports(1)
    settings = Settings(model="fake", host="127.0.0.1", grpc_port=port, **overrides)
    server = await start_grpc_server(ServerState(settings), settings)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await stop_grpc_server(server, grace_s=0)


async def health_check(channel: grpc.aio.Channel) -> Any:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_check(channel)
    return info.value.code()


async def test_grpc_over_tls_and_mutual_tls(tls: TlsFiles) -> None:
    ca = tls.ca.read_bytes()
    client = (tls.client_key.read_bytes(), tls.client_cert.read_bytes())
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING  # no model loaded: answered
    async with grpc_server(tls_cert_file=tls.cert, tls_key_file=tls.key) as address:
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            assert await health_check(channel) == not_serving
        async with grpc.aio.insecure_channel(address) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE
    files = {"tls_cert_file": tls.cert, "tls_key_file": tls.key, "tls_ca_file": tls.ca}
    async with grpc_server(**files) as address:
        with_certificate = grpc.ssl_channel_credentials(ca, *client)
        async with grpc.aio.secure_channel(address, with_certificate) as channel:
            assert await health_check(channel) == not_serving
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            assert await refused(channel) == grpc.StatusCode.UNAVAILABLE


def test_tls_files_that_do_not_fit_are_refused_naming_them(tls: TlsFiles) -> None:
    with pytest.raises(ConfigError, match="give both tls_cert_file and tls_key_file"):
        load_settings(tls_cert_file=str(tls.cert))
    with pytest.raises(ConfigError, match="tls_ca_file asks clients for certificates"):
        load_settings(tls_ca_file=str(tls.ca))
    with pytest.raises(ConfigError) as mismatch:
        load_settings(tls_cert_file=str(tls.cert), tls_key_file=str(tls.other_key))
    assert f"tls_cert_file {str(tls.cert)!r} and tls_key_file {str(tls.other_key)!r}" in str(
        mismatch.value
    )
    missing = Path(tls.ca.parent, "none.pem")
    with pytest.raises(ConfigError, match="No such file"):
        load_settings(tls_cert_file=str(tls.cert), tls_key_file=str(tls.key), tls_ca_file=missing)
    settings = load_settings(tls_cert_file=str(tls.cert), tls_key_file=str(tls.key))
    assert settings.tls and not load_settings().tls
