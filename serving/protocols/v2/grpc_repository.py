"""Triton's model repository extension over gRPC: ``RepositoryIndex``, ``RepositoryModelLoad``
and ``RepositoryModelUnload``, answered by the server's ``RepositoryControl`` (the manager that
HTTP's ``/v2/repository/...`` routes call too).

Load and unload change what the server serves, so they want the admin token as HTTP's do
(``serving.http.admin_token``, the same check and refusals): the call's ``authorization: Bearer
<token>`` metadata (gRPC's metadata are the HTTP/2 request's headers). Every refusal is a
``ShardServeError`` that ``grpc_server`` turns into the call's status:

    no bearer token in the metadata                 UNAUTHENTICATED (UnauthorizedError)
    a wrong token                                   PERMISSION_DENIED (ForbiddenError)
    no --admin-token on the server                  NOT_FOUND (off, as HTTP's 404 says)
    unknown model or repository name                NOT_FOUND, naming what there is
    a parameter shardserve does not take            INVALID_ARGUMENT, naming it
    no repository yet (starting) or any more        UNAVAILABLE (NotReadyError)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from serving.errors import InvalidInputError, NotFoundError, NotReadyError
from serving.http.admin_token import check_admin_token
from serving.protocols.v2.proto import grpc_service_pb2 as pb
from serving.quoting import quote

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pydantic import SecretStr

    from serving.protocols.contract import RepositoryControl

__all__ = ["ADMIN_METHODS", "ADMIN_WHAT", "Metadata", "RepositoryRpcs", "RepositorySource"]

# The server's repository control, looked up per call: ``None`` until the lifespan has made
# it (and in a server that has none).
RepositorySource: TypeAlias = "Callable[[], RepositoryControl | None]"
Metadata: TypeAlias = "Sequence[tuple[str, str | bytes]]"

NO_REPOSITORY = "the model repository is not running (the server is starting or stopping); retry"
ADMIN_WHAT = "repository load and unload"
# The calls that take the admin token (the gRPC port refuses it in clear text from another
# machine: serving.protocols.grpc_limits).
ADMIN_METHODS = frozenset(
    f"/inference.GRPCInferenceService/{rpc}"
    for rpc in ("RepositoryModelLoad", "RepositoryModelUnload")
)
# tritonclient's unload_model always sends it; no model here depends on another, so either
# value unloads exactly the model named.
UNLOAD_DEPENDENTS = "unload_dependents"


def _check_token(metadata: Metadata, admin_token: SecretStr | None) -> None:
    # gRPC lowercases metadata keys; only "-bin" keys carry bytes.
    header = next((v for k, v in metadata if k == "authorization"), None)
    check_admin_token(header if isinstance(header, str) else None, admin_token, ADMIN_WHAT)


def _check_repository_name(name: str) -> None:
    if name:
        raise NotFoundError(
            f"repository {quote(name)} not found; this server has one model repository: "
            "leave repository_name empty"
        )


def _check_model_name(name: str, rpc: str) -> str:
    if not name:
        raise InvalidInputError(
            f"{rpc}: model_name is empty; name a model of the repository (RepositoryIndex "
            "lists them)"
        )
    return name


def _check_load_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> None:
    # Triton's "config" and "file:<version>/<name>" would load something other than the files
    # on disk, which polling and the index describe.
    if parameters:
        raise InvalidInputError(
            f"RepositoryModelLoad parameter {quote(min(parameters))} is not supported: a model is "
            "loaded from its directory in the repository (its settings in <model>/config.toml, "
            "its files in <model>/<version>/); send no parameters"
        )


def _check_unload_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> None:
    for key in sorted(parameters):
        if key != UNLOAD_DEPENDENTS:
            raise InvalidInputError(
                f"RepositoryModelUnload parameter {quote(key)} is not supported; the one taken is "
                f"{UNLOAD_DEPENDENTS!r} (a bool)"
            )
        if parameters[key].WhichOneof("parameter_choice") != "bool_param":
            raise InvalidInputError(
                f"RepositoryModelUnload parameter {quote(key)} must be a bool_param"
            )


class RepositoryRpcs:
    """The three calls' work; ``grpc_server``'s servicer answers errors and logs."""

    def __init__(self, source: RepositorySource, admin_token: SecretStr | None) -> None:
        self._source = source
        self._admin_token = admin_token

    def _control(self) -> RepositoryControl:
        control = self._source()
        if control is None:
            raise NotReadyError(NO_REPOSITORY)
        return control

    async def index(
        self, request: pb.RepositoryIndexRequest, metadata: Metadata
    ) -> pb.RepositoryIndexResponse:
        _check_repository_name(request.repository_name)
        entries = self._control().index(ready_only=request.ready)
        Entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(
            models=[
                Entry(
                    name=e["name"],
                    version=e["version"],
                    state=e["state"],
                    reason=e["reason"],
                )
                for e in entries
            ]
        )

    async def load(
        self, request: pb.RepositoryModelLoadRequest, metadata: Metadata
    ) -> pb.RepositoryModelLoadResponse:
        rpc = "RepositoryModelLoad"
        _check_token(metadata, self._admin_token)
        _check_repository_name(request.repository_name)
        name = _check_model_name(request.model_name, rpc)
        _check_load_parameters(request.parameters)
        # Shielded: a client that hangs up (or whose deadline passes) mid-load leaves the
        # repository to finish it, not half done.
        await asyncio.shield(self._control().load(name))
        return pb.RepositoryModelLoadResponse()

    async def unload(
        self, request: pb.RepositoryModelUnloadRequest, metadata: Metadata
    ) -> pb.RepositoryModelUnloadResponse:
        rpc = "RepositoryModelUnload"
        _check_token(metadata, self._admin_token)
        _check_repository_name(request.repository_name)
        name = _check_model_name(request.model_name, rpc)
        _check_unload_parameters(request.parameters)
        # Shielded as load: a drain cut short would leave versions that refuse requests but
        # still hold their actors.
        await asyncio.shield(self._control().unload(name))
        return pb.RepositoryModelUnloadResponse()
