"""The OpenAPI document is a contract: ``schemathesis run .../openapi.json --checks all``, as a
user would run it, finds nothing against a real server, on every route (V2 and admin included,
the admin token given): no server error, every status and header documented, every body fitting
its schema, schema-valid requests accepted and invalid ones refused, 405 with ``Allow``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serverproc import BIN, Server, running_server

TOKEN = "contract-token"
MAX_EXAMPLES = 25  # per operation and phase; the coverage phase adds its boundary cases


@pytest.fixture(scope="module")
def server(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("contract")
    args = [
        "--model", "demo-tiny",
        "--ray-address", ray_address,
        "--cache-dir", str(workdir / "cache"),
        "--admin-token", TOKEN,
        "--max-batch-size", "8",
        "--batch-timeout-ms", "2",
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
    return output


def operations(doc: dict[str, object], *, method: str | None = None) -> int:
    paths = doc["paths"]
    assert isinstance(paths, dict)
    return sum(1 for ops in paths.values() for m in ops if method in (None, m))


def test_schemathesis_finds_no_contract_failure(server: Server, tmp_path: Path) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    paths = doc["paths"]
    assert {"/predict", "/v2/models/{name}/infer", "/admin/batching", "/metrics"} <= set(paths)
    puts = operations(doc, method="put")
    assert puts == 1  # PUT /admin/batching

    # The policy a PUT draws (a 1e9 ms batch wait, say) would hold every later predict until
    # its deadline: the PUT runs alone, last.
    everything_else = run_schemathesis(server, tmp_path, "--exclude-method", "PUT")
    assert f"Tested: {operations(doc) - puts}" in everything_else, everything_else[-3000:]
    admin = run_schemathesis(server, tmp_path, "--include-path", "/admin/batching")
    assert "Tested: 2" in admin, admin[-3000:]
