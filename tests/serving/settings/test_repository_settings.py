"""The repository's settings from every source: either a model or a repository, the default
model's name, polling only with a repository; errors that name the value and the way out."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from serving.settings.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def test_defaults_serve_one_model_and_no_repository() -> None:
    s = load_settings()
    assert (s.model, s.model_repository, s.default_model, s.repository_poll_s) == (
        "demo-mlp",
        None,
        None,
        0.0,
    )


def test_a_repository_from_env_and_toml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_MODEL_REPOSITORY", str(tmp_path))
    config = tmp_path / "server.toml"
    config.write_text('default-model = "resnet"\nrepository_poll_s = 10\n')
    s = load_settings(config)
    assert (s.model_repository, s.default_model, s.repository_poll_s) == (tmp_path, "resnet", 10)


def test_the_repository_path_expands_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    assert load_settings(model_repository="~/models").model_repository == tmp_path / "models"


@pytest.mark.parametrize("source", ["flag", "env", "toml"])
def test_a_model_and_a_repository_are_refused_from_any_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    config = tmp_path / "server.toml"
    config.write_text('model = "m.keras"\n' if source == "toml" else "")
    if source == "env":
        monkeypatch.setenv("SHARDSERVE_MODEL", "m.keras")
    flags = {"model": "m.keras"} if source == "flag" else {}
    with pytest.raises(ConfigError, match=r"give either model \('m.keras'\) or model_repository"):
        load_settings(config, model_repository=tmp_path, **flags)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"model_repository": "/no/such/dir"}, "no directory at '/no/such/dir'"),
        ({"repository_poll_s": 5}, "repository_poll_s (5) polls a model repository"),
        ({"repository_poll_s": -1}, "repository_poll_s: Input should be greater than or equal"),
        ({"default_model": "../etc"}, "'../etc' is not a model name"),
        ({"default_model": "resnet"}, "with --model the one model ('demo-mlp') is the default"),
    ],
)
def test_bad_repository_settings_name_the_value(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(**flags)
    assert message in str(caught.value)


def test_with_one_model_the_default_model_may_name_it() -> None:
    assert load_settings(model="demo-tiny", default_model="demo-tiny").default_model == "demo-tiny"
