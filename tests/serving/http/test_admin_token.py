"""The admin token is refused where it came in clear text over a network (issue 37, item 10): a
port without TLS and a client other than the loopback address, unless
``allow_plaintext_admin``; over HTTP (the admin routes, the repository's load and unload) and
gRPC (the repository's load and unload)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import httpx
import pytest
from asgi_lifespan import LifespanManager
from pydantic import SecretStr

from serving.errors import ForbiddenError
from serving.http.admin_token import Transport, check_admin_transport, is_loopback
from serving.protocols.grpc_limits import CallLimits, peer_host
from serving.server.app import create_app
from serving.settings.config import Settings
from tests.fakes import FakeRunner

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REMOTE = ("203.0.113.9", 40000)
CLEAR_TEXT = (
    "admin routes take the admin token only over TLS or from the server's own machine: here it "
    "would travel in clear text; serve TLS (--tls-cert-file, --tls-key-file), or start the server "
    "with --allow-plaintext-admin where a proxy in front of it ends TLS"
)


@contextlib.asynccontextmanager
async def client_from(
    client: tuple[str, int], *, scheme: str = "http", **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(model="fake", admin_token=TOKEN, **overrides)

    async def factory(_: Settings) -> FakeRunner:
        return FakeRunner()

    app = create_app(settings, factory)
    async with LifespanManager(app) as manager:
        await app.state.shardserve.model().until_ready()
        transport = httpx.ASGITransport(app=manager.app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url=f"{scheme}://test") as http:
            yield http


async def test_the_admin_token_in_clear_text_from_another_machine_is_refused() -> None:
    async with client_from(REMOTE) as remote:
        refused = await remote.get("/admin/batching", headers=AUTH)
        load = await remote.post("/v2/repository/models/fake/load", headers=AUTH, json={})
    assert refused.status_code == 403
    assert refused.json() == {"error": CLEAR_TEXT}
    assert load.status_code == 403
    assert "repository load and unload take the admin token only over TLS" in load.json()["error"]


@pytest.mark.parametrize(
    ("client", "scheme", "overrides"),
    [
        (("127.0.0.1", 40000), "http", {}),  # the server's own machine
        (("::1", 40000), "http", {}),
        (REMOTE, "https", {}),  # over TLS
        (REMOTE, "http", {"allow_plaintext_admin": True}),  # a proxy in front ends TLS
    ],
)
async def test_the_token_is_taken_over_tls_from_loopback_or_where_allowed(
    client: tuple[str, int], scheme: str, overrides: dict[str, Any]
) -> None:
    async with client_from(client, scheme=scheme, **overrides) as http:
        ok = await http.get("/admin/batching", headers=AUTH)
        wrong = await http.get("/admin/batching", headers={"Authorization": "Bearer no"})
    assert (ok.status_code, wrong.status_code) == (200, 403)
    assert wrong.json()["error"] == "the bearer token does not match the server's admin token"


def test_which_addresses_are_loopback() -> None:
    assert [is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "::ffff:127.0.0.1")] == [
        True
    ] * 4
    assert [is_loopback(h) for h in ("10.0.0.1", "::ffff:10.0.0.1", "0.0.0.0", "x", "", None)] == [
        False
    ] * 6
    token = SecretStr(TOKEN)
    check_admin_transport(None, Transport(False, "10.0.0.1"), False, "admin routes")  # off: 404
    with pytest.raises(ForbiddenError):
        check_admin_transport(token, Transport(False, None), False, "admin routes")


def test_grpc_peers_are_read_as_addresses() -> None:
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "::1"
    assert peer_host("ipv6:%5B::1%5D:5000") == "::1"
    assert peer_host("unix:/tmp/s") is None


class _Aborted(Exception):
    pass


class _CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str, *_: Any) -> None:
        self.aborted = (code, details)
        raise _Aborted

    async def read(self) -> Any:
        return "request"


@pytest.mark.parametrize(
    ("peer", "overrides", "denied"),
    [
        ("ipv4:203.0.113.9:5000", {}, True),
        ("ipv4:127.0.0.1:5000", {}, False),
        ("ipv4:203.0.113.9:5000", {"allow_plaintext_admin": True}, False),
    ],
)
async def test_grpc_admin_calls_are_refused_in_clear_text_from_another_machine(
    peer: str, overrides: dict[str, Any], denied: bool
) -> None:
    settings = Settings(model="fake", admin_token=TOKEN, **overrides)
    limits = CallLimits(settings, frozenset({"/s/Load"}), "repository load and unload")
    inner_called = []

    async def inner(request: Any, context: Any) -> str:
        inner_called.append(request)
        return "done"

    handler = grpc.unary_unary_rpc_method_handler(inner)

    async def continuation(_: Any) -> grpc.RpcMethodHandler:
        return handler

    details = _CallDetails("/s/Load", ())
    wrapped = await limits.intercept_service(continuation, details)
    assert wrapped is not None
    context = _Context(peer)
    with contextlib.suppress(_Aborted):
        await wrapped.stream_unary(None, context)
    if denied:
        assert context.aborted is not None
        code, message = context.aborted
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert message.startswith("repository load and unload take the admin token only over TLS")
        assert inner_called == []
    else:
        assert (context.aborted, inner_called) == (None, ["request"])
