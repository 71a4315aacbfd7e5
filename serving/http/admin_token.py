"""The admin token check the admin routes and the repository API's load and unload share: the
server's ``--admin-token`` as an ``Authorization: Bearer`` header. Without a token the routes
are off (404, as if absent)."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from serving.errors import ForbiddenError, NotFoundError, UnauthorizedError

if TYPE_CHECKING:
    from pydantic import SecretStr

__all__ = ["check_admin_token"]


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
