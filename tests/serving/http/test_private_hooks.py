"""The private APIs of uvicorn and FastAPI that the fast path hooks into, checked against the
installed versions. pyproject bounds both below their next minor release; these tests are what
says, naming the hook, that a newer release removed or changed one (the code falls back to the
slower path without a word, so nothing else would fail)."""

from __future__ import annotations

import inspect

from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from serving.http.protocol import http_protocol
from serving.server.app import _untraced
from serving.settings.config import Settings

_UPGRADE = "pin the version in pyproject.toml or port serving/http/protocol.py to the new API"


def test_uvicorn_calls_start_asgi_task_with_the_cycle() -> None:
    hook = getattr(HttpToolsProtocol, "_start_asgi_task", None)
    assert callable(hook), (
        f"uvicorn's HttpToolsProtocol._start_asgi_task is gone, so queue-full refusals from "
        f"the headers are off; {_UPGRADE}"
    )
    assert list(inspect.signature(hook).parameters) == ["self", "cycle", "app"], (
        f"uvicorn's HttpToolsProtocol._start_asgi_task{inspect.signature(hook)} no longer "
        f"takes (cycle, app); {_UPGRADE}"
    )
    caller = inspect.getsource(HttpToolsProtocol.on_headers_complete)
    assert "self._start_asgi_task(self.cycle, app)" in caller, (
        f"uvicorn's HttpToolsProtocol.on_headers_complete no longer starts a request through "
        f"self._start_asgi_task(self.cycle, app); {_UPGRADE}"
    )


def test_uvicorn_cycle_has_what_the_refusal_sets() -> None:
    assert "self.cycle" in inspect.getsource(HttpToolsProtocol.__init__), (
        f"uvicorn's HttpToolsProtocol has no self.cycle (read on connection_lost); {_UPGRADE}"
    )
    cycle = inspect.getsource(RequestResponseCycle.__init__)
    used = ("scope", "keep_alive", "response_started", "response_complete", "message_event")
    missing = [name for name in (*used, "on_response") if f"self.{name} =" not in cycle]
    assert missing == [], (
        f"uvicorn's RequestResponseCycle has no {missing} (serving/http/protocol.py sets or "
        f"calls them); {_UPGRADE}"
    )


def test_the_protocol_overrides_the_hooks_it_names() -> None:
    from serving.server.app import create_app

    protocol = http_protocol(create_app(Settings(model="fake")))
    assert isinstance(protocol, type) and issubclass(protocol, HttpToolsProtocol)
    for name in ("_start_asgi_task", "connection_lost"):
        assert name in vars(protocol) and name in vars(HttpToolsProtocol), name


def test_fastapi_native_telemetry_says_it_is_off() -> None:
    app = FastAPI()
    telemetry = getattr(app, "_native_telemetry", None)
    assert callable(getattr(telemetry, "enabled", None)), (
        "FastAPI's app._native_telemetry.enabled() is gone, so ShardServeApp takes FastAPI's "
        "full stack on every request (and answers no route early); pin fastapi in "
        "pyproject.toml or port serving/server/app.py's _untraced to the new API"
    )
    assert _untraced(app), "FastAPI's _native_telemetry.enabled() is True with no telemetry set"
    caller = inspect.getsource(FastAPI.__call__)
    assert "self._native_telemetry.enabled()" in caller, (
        "FastAPI.__call__ no longer asks self._native_telemetry.enabled(); what ShardServeApp "
        "skips may have changed: port serving/server/app.py's __call__"
    )
