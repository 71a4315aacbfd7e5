"""schemathesis over the OpenAPI document of an in-process server (the fake runner behind a real
uvicorn, in a thread of its own): on every operation but the ones that change what later ones
see (the admin PUTs, the repository's unload), no generated request, valid or not, gets a 5xx
(issue 37: one header of 5,000 digits was a 500). The e2e contract test
(``tests/e2e/test_openapi_contract.py``) runs the whole CLI with ``--checks all`` against a real
model; this one is small and fast, and runs with every test."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes import WAIT_S
from tests.serving.http.uvicorn_server import running

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def api() -> Iterator[Any]:
    """The server's own document, loaded by schemathesis, with the server's address."""
    ready = threading.Event()
    found: list[str] = []
    stop: list[Any] = []

    async def run() -> None:
        overrides = {"admin_token": TOKEN, "max_queue_rows": 64, "max_body_bytes": 1 << 20}
        async with running(**overrides) as server:
            done = asyncio.Event()
            stop.append((asyncio.get_running_loop(), done))
            found.append(str(server.client.base_url))
            ready.set()
            await done.wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    assert ready.wait(WAIT_S * 3), "the server did not start"
    yield schemathesis.openapi.from_url(f"{found[0].rstrip('/')}/openapi.json")
    loop, done = stop[0]
    loop.call_soon_threadsafe(done.set)
    thread.join(WAIT_S)


def test_no_generated_request_gets_a_server_error(api: Any) -> None:
    # Drawn from each operation's strategy inside the test: the document is the running
    # server's (schemathesis' own pytest plugin loads it from a fixture through pytest
    # internals that pytest 9 changed).
    selected = api.exclude(method="PUT").exclude(path_regex="/unload$")
    operations = [result.ok() for result in selected.get_all_operations()]
    assert len(operations) > 10
    cases = st.one_of(*(operation.as_strategy() for operation in operations))
    auth = {"Authorization": f"Bearer {TOKEN}"}

    @settings(
        max_examples=10 * len(operations),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def call(case: schemathesis.Case) -> None:
        response = case.call(headers=auth, timeout=WAIT_S)
        assert response.status_code < 500, (case.method, case.path, response.text[:500])

    call()
