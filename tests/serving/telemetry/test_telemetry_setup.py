"""Tracing's start: on without the ``tracing`` extra is one line naming the extra (the CLI exits
2, the lifespan raises a ``ConfigError``), not a ``ModuleNotFoundError`` traceback; the endpoint
is logged without the credentials a URL may carry."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest
from typer.testing import CliRunner

from serving.cli import serve as serve_cli
from serving.cli.main import app
from serving.settings.config import ConfigError, Settings
from serving.telemetry import active, setup


@pytest.fixture
def no_opentelemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_serve_with_an_endpoint_and_no_extra_names_the_extra_in_one_line(
    no_opentelemetry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[Settings] = []
    monkeypatch.setattr(serve_cli, "run_server", served.append)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 2 and not served
    assert "Traceback" not in result.output
    # One line (the console wraps it at its width).
    assert " ".join(result.output.split()) == (
        "error: tracing is on (an OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT variable is set) but "
        "opentelemetry.sdk is not installed: pip install 'shardserve[tracing]', or turn "
        "tracing off (OTEL_SDK_DISABLED=true)"
    )


def test_the_lifespan_refuses_in_one_line_too(
    no_opentelemetry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setattr(active, "tracer", None)
    with pytest.raises(ConfigError, match=r"otlp_endpoint is set\) but opentelemetry\.sdk"):
        setup.start(Settings(otlp_endpoint="http://collector:4318"))
    assert active.tracer is None


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        ("https://user:s3cret@collector:4318/v1/traces", "https://collector:4318/v1/traces"),
        ("https://collector/v1/traces?api_key=s3cret#x", "https://collector/v1/traces"),
        ("http://[::1]:4317", "http://[::1]:4317"),
        ("http://collector:4318/v1/traces", "http://collector:4318/v1/traces"),
    ],
)
def test_the_endpoint_is_logged_without_credentials(endpoint: str, shown: str) -> None:
    assert setup.shown_endpoint(endpoint) == shown


def test_the_start_line_says_where_without_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from serving.telemetry import traces

    made: list[float] = []
    # No provider: one would export to the endpoint for the rest of the session.
    monkeypatch.setattr(
        traces, "Tracer", lambda client_sampled_per_s: made.append(client_sampled_per_s) or object()
    )
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    # Set first, so that the variable start() writes is taken out again after the test.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.setattr(active, "tracer", None)
    settings = Settings(otlp_endpoint="https://user:s3cret@collector:4318/v1/traces")
    with caplog.at_level(logging.INFO, logger="shardserve"):
        setup.start(settings)
    try:
        assert made == [10.0]  # the setting's default reaches the tracer
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "exporting OTLP (http/protobuf) to https://collector:4318/v1/traces" in text
        assert "s3cret" not in text
    finally:
        monkeypatch.setattr(active, "tracer", None)
