"""A model's config.toml: the server's settings per model, [versions] and [labels]; what is
refused and how the error reads; the settings one version is served with."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

from serving.repository.layout import VersionDir, scan
from serving.repository.model_config import (
    SERVER_WIDE,
    ModelConfig,
    model_keys,
    model_settings,
    read_model_config,
)
from serving.repository.version_policy import VersionPolicy
from serving.settings.config import ConfigError, Settings, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def model_dir(root: Path, toml: str | None, name: str = "resnet") -> Path:
    path = root / name
    (path / "3").mkdir(parents=True)
    with zipfile.ZipFile(path / "3" / f"{name}.keras", "w") as archive:
        archive.writestr("config.json", "{}")
    if toml is not None:
        (path / "config.toml").write_text(toml)
    return path


def version(root: Path, name: str = "resnet") -> VersionDir:
    return scan(root)[name][3]


def test_no_file_means_the_server_values_and_the_latest_version(tmp_path: Path) -> None:
    assert read_model_config(model_dir(tmp_path, None)) == ModelConfig(
        overrides={}, policy=VersionPolicy("latest", 1), labels={}
    )


def test_the_issue_example_reads_as_written(tmp_path: Path) -> None:
    toml = """
stages = 4
replicas = 2
max-batch-size = 32
[versions]
policy = "latest"
n = 2
[labels]
stable = 3
canary = 4
"""
    config = read_model_config(model_dir(tmp_path, toml))
    assert config.overrides == {"stages": 4, "replicas": 2, "max_batch_size": 32}
    assert config.policy == VersionPolicy("latest", n=2)
    assert config.labels == {"stable": 3, "canary": 4}
    assert read_model_config(
        model_dir(tmp_path, '[versions]\npolicy = "specific"\nversions = [3, 1]', "b")
    ).policy == VersionPolicy("specific", versions=(1, 3))


def test_an_unknown_key_names_the_file_the_key_and_what_is_allowed(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "stages = 2\nmax_batch = 8\nwarmup = true\n")
    with pytest.raises(ConfigError) as caught:
        read_model_config(path)
    message = str(caught.value)
    assert message.startswith(
        "resnet/config.toml: unknown keys 'max_batch', 'warmup' (did you mean 'max_batch_size'?);"
        " allowed:"
    )
    assert "[traffic] and [canary]" in message and "'max_batch_size'" in message
    assert str(tmp_path) not in message and "\n" not in message


@pytest.mark.parametrize("key", ["port", "admin-token", "ray_address", "model", "imports"])
def test_a_server_wide_key_is_refused_with_the_reason(tmp_path: Path, key: str) -> None:
    value = '["m"]' if key == "imports" else '"x"'
    with pytest.raises(ConfigError) as caught:
        read_model_config(model_dir(tmp_path, f"{key} = {value}\n"))
    message = str(caught.value)
    assert message.startswith(f"resnet/config.toml: {key!r} is server-wide (")
    assert SERVER_WIDE[key.replace("-", "_")] in message
    assert message.endswith("set it for the server (flag, env var or --config), not per model")


def test_every_setting_is_either_per_model_or_server_wide() -> None:
    per_model = set(model_keys())
    assert per_model | set(SERVER_WIDE) == set(Settings.model_fields)
    assert not per_model & set(SERVER_WIDE)
    assert {"model_repository", "default_model", "repository_poll_s"} <= set(SERVER_WIDE)
    assert {"stages", "replicas", "max_batch_size", "batch_timeout_ms"} <= per_model


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("this is = not toml", "resnet/config.toml is not valid TOML"),
        ("[versions]\npolicy = 'newest'", "[versions] policy must be one of"),
        ("[versions]\npolicy = 'all'\nn = 2", 'n is only read with policy = "latest"'),
        ("[versions]\npolicy = 'specific'", 'policy "specific" needs versions'),
        ("[versions]\npolicy = 'specific'\nversions = 3", "versions must be a list"),
        ("[versions]\nkeep = 2", "unknown key(s) ['keep'] in [versions]"),
        ("versions = 2", "versions must be a table"),
        ("[labels]\nstable = '3'", "[labels] stable must be a version number"),
        ("[labels]\nstable = 0", "[labels] stable must be a version number"),
        ('[labels]\n"a/b" = 1', "label 'a/b' must be letters"),
    ],
)
def test_bad_tables_name_the_file_and_the_value(tmp_path: Path, toml: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        read_model_config(model_dir(tmp_path, toml))
    assert message in str(caught.value)
    assert str(caught.value).startswith("resnet/config.toml")


def test_a_version_gets_the_server_values_its_overrides_and_its_own_path(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "max_batch_size = 8\nbatch_timeout_ms = 'auto'\n")
    base = load_settings(
        model_repository=tmp_path, max_batch_size=64, replicas=2, admin_token="secret"
    )
    served = model_settings(base, "resnet", version(tmp_path), read_model_config(path))
    assert served.model == str(path / "3" / "resnet.keras")
    assert served.served_name() == "resnet"
    assert (served.max_batch_size, served.batch_timeout_ms, served.replicas) == (8, "auto", 2)
    assert served.admin_token is not None and served.admin_token.get_secret_value() == "secret"
    assert (served.model_repository, served.default_model, served.repository_poll_s) == (
        None,
        None,
        0.0,
    )
    assert base.max_batch_size == 64  # the server's own settings are left as they were


def test_env_vars_do_not_change_a_versions_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = model_dir(tmp_path, "max_batch_size = 8\n")
    monkeypatch.setenv("SHARDSERVE_MODEL_REPOSITORY", str(tmp_path))
    base = load_settings()
    assert base.model_repository == tmp_path
    monkeypatch.setenv("SHARDSERVE_MAX_BATCH_SIZE", "128")
    monkeypatch.setenv("SHARDSERVE_REPLICAS", "3")
    served = model_settings(base, "resnet", version(tmp_path), read_model_config(path))
    assert (served.max_batch_size, served.replicas) == (8, 1)


def test_a_model_that_sets_its_stages_replaces_the_servers_memory_budget(tmp_path: Path) -> None:
    path = model_dir(tmp_path, "stages = 2\n")
    base = load_settings(model_repository=tmp_path, max_stage_bytes="4GiB")
    served = model_settings(base, "resnet", version(tmp_path), read_model_config(path))
    assert (served.stages, served.max_stage_bytes) == (2, None)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            "max_batch_size = 0",
            "max_batch_size: Input should be greater than or equal to 1 (got 0)",
        ),
        ("stages = 'four'", "stages: Input should be a valid integer"),
        (
            "max_batch_size = 4\nallowed_batch_sizes = [2, 8]",
            "allowed_batch_sizes must be sizes between 1 and max_batch_size (4), got [2, 8]",
        ),
    ],
)
def test_bad_values_are_one_line_naming_the_file_and_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = model_dir(tmp_path, toml)
    base = load_settings(model_repository=tmp_path)
    with pytest.raises(ConfigError) as caught:
        model_settings(base, "resnet", version(tmp_path), read_model_config(path))
    text = str(caught.value)
    assert text.startswith("resnet/config.toml: ") and message in text
    assert "\n" not in text


def test_a_version_changed_since_the_scan_is_a_config_error(tmp_path: Path) -> None:
    path = model_dir(tmp_path, None)
    found = version(tmp_path)
    (path / "3" / "resnet.keras").unlink()
    base = load_settings(model_repository=tmp_path)
    with pytest.raises(ConfigError, match=r"resnet/3 no longer holds one \.keras file"):
        model_settings(base, "resnet", found, read_model_config(path))
