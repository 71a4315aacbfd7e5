"""``shardserve tune`` without its extra says what to install instead of failing on an import."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from typer.testing import CliRunner

from serving.cli.main import app


def test_tune_without_locust_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "locust" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    result = CliRunner().invoke(app, ["tune", "--url", "http://127.0.0.1:9", "--out", "x"])
    assert result.exit_code == 2
    assert "needs locust: pip install 'shardserve[loadtest]'" in result.output
