"""The admin token check the admin routes and the repository API's load and unload share: the
server's ``--admin-token`` as an ``Authorization: Bearer`` header. Without a token the routes
are off (404, as if absent).

The token is refused, before it is compared, where it came in clear text over a network: a
port without TLS and a client other than the loopback address (``check_admin_transport``), unless
``--allow-plaintext-admin`` (a proxy in front that ends TLS) says so. Whoever reads the
network's traffic would otherwise hold the token.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from serving.errors import ForbiddenError, NotFoundError, UnauthorizedError

if TYPE_CHECKING:
    from pydantic import SecretStr

__all__ = ["Transport", "check_admin_token", "check_admin_transport", "is_loopback"]


class Transport(NamedTuple):
    """How a request came: over TLS or not, and from which address (the peer's host)."""

    tls: bool
    client: str | None

    @classmethod
    def of(cls, scope: Mapping[str, Any]) -> Transport:
        """An ASGI request's."""
        client = scope.get("client")
        return cls(scope.get("scheme") == "https", client[0] if client else None)


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address) is this machine's loopback: 127.0.0.0/8, ::1, or an
    IPv4-mapped 127.x."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_admin_transport(
    token: SecretStr | None, transport: Transport, allow_plaintext: bool, what: str
) -> None:
    """Refuse the request (403) where the admin token would come in clear text over a network;
    nothing to check for a server without a token (its routes are off: ``check_admin_token``)."""
    if token is None or transport.tls or allow_plaintext or is_loopback(transport.client):
        return
    raise ForbiddenError(
        f"{what} take the admin token only over TLS or from the server's own machine: here it "
        "would travel in clear text; serve TLS (--tls-cert-file, --tls-key-file), or start the "
        "server with --allow-plaintext-admin where a proxy in front of it ends TLS"
    )


def check_admin_token(authorization: str | None, token: SecretStr | None, what: str) -> None:
    """Refuse the request unless ``authorization`` (the header) is ``Bearer <token>``; ``what``
    names the routes in the refusals (``"admin routes"``)."""
    if token is None:
        raise NotFoundError(f"{what} are off; start the server with --admin-token to use them")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise UnauthorizedError(f"{what} need the header 'Authorization: Bearer <admin token>'")
    # Constant-time comparison so that the token cannot be guessed byte by byte from timings.
    if not hmac.compare_digest(given.strip().encode(), token.get_secret_value().encode()):
        raise ForbiddenError("the bearer token does not match the server's admin token")
