"""The OpenAPI document is a contract: ``schemathesis run .../openapi.json --checks all``, as a
user would run it, finds nothing against a real server at its default settings, on every route
(V2 and admin included, the admin token given): no server error, every status and header
documented, every body fitting its schema, schema-valid requests accepted and invalid ones
refused, 405 with ``Allow``. The GETs run again after the admin PUTs, and in the same stateful
run as them: no change a PUT accepts may break a route that shows the policy, or make a request
the document allows a refused one. The repository API's unload runs last, on its own: it takes
the model away from every route after it (and a load after it would start the model's actors
again, seconds each time); a load of the served model, in the first run, changes nothing.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.server.admin_routes import ADMIN_FIELDS
from tests.serverproc import BIN, Server, running_server

TOKEN = "contract-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Per operation, for the random phases (fuzzing, stateful); the coverage phase's boundary
# cases (positive and negative, per parameter) do not depend on it. Side by side on a busy
# machine, the random phases of the four runs took 20 s at 10 against 52 s at 20, and the
# coverage phases ~37 s either way.
MAX_EXAMPLES = 10


@pytest.fixture(scope="module")
def server(
    ray_address: str, demo_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("contract")
    args = [
        "--model", "demo-tiny",
        "--ray-address", ray_address,
        "--cache-dir", str(demo_cache),
        "--admin-token", TOKEN,
        "--grpc-port", "0",
    ]  # fmt: skip
    with running_server(args, workdir) as srv:
        yield srv


def run_schemathesis(server: Server, workdir: Path, *selection: str) -> str:
    command = [
        str(BIN / "schemathesis"), "run", f"{server.url}/openapi.json",
        "--checks", "all",
        "--header", f"Authorization: Bearer {TOKEN}",
        "--max-examples", str(MAX_EXAMPLES),
        "--seed", "20261122",
        "--generation-database", "none",
        "--no-color",
        "--output-truncate", "false",
        *selection,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    assert "No issues found" in output, output[-8000:]  # no failure, and no error either
    return output


def operations(doc: dict[str, object], *, method: str | None = None) -> int:
    paths = doc["paths"]
    assert isinstance(paths, dict)
    return sum(1 for ops in paths.values() for m in ops if method in (None, m))


def test_schemathesis_finds_no_contract_failure(server: Server, tmp_path: Path) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    paths = doc["paths"]
    assert {"/predict", "/v2/models/{name}/infer", "/admin/batching", "/metrics"} <= set(paths)
    assert {"/v2/repository/index", "/v2/repository/models/{name}/unload"} <= set(paths)
    puts, gets = operations(doc, method="put"), operations(doc, method="get")
    assert puts == 3  # PUT /admin/batching, /admin/models/{name}[/versions/{version}]/batching
    # No generate route, nor its admin route, for a model that does not generate (only 404).
    assert not any("/generat" in path for path in paths)

    # A PUT may set a batch wait of up to the request timeout (30 s), which every later predict
    # of a few rows would wait out: the predicts run before the PUTs. An unload would take the
    # model from every route after it: it runs last (a load of a served model changes nothing).
    everything_else = run_schemathesis(
        server, tmp_path, "--exclude-method", "PUT", "--exclude-path-regex", "/unload$"
    )
    assert f"Tested: {operations(doc) - puts - 1}" in everything_else, everything_else[-3000:]

    def policy() -> dict[str, object]:
        view = httpx.get(f"{server.url}/admin/batching", headers=AUTH, timeout=10).json()
        return {field: view[field] for field in ADMIN_FIELDS}

    before = policy()
    admin = run_schemathesis(server, tmp_path, "--include-method", "PUT", "--include-method", "GET")
    assert f"Tested: {puts + gets}" in admin, admin[-3000:]
    assert policy() != before
    # The GETs again, under whatever policy the last PUT left.
    again = run_schemathesis(server, tmp_path, "--include-method", "GET")
    assert f"Tested: {gets}" in again, again[-3000:]
    unload = run_schemathesis(server, tmp_path, "--include-path-regex", "/unload$")
    assert "Tested: 1" in unload, unload[-3000:]
