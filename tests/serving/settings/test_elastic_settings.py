"""The elastic replica settings: bounds from --replicas or --min/--max-replicas, the count a
version starts at, a conflicting count refused with the fix, flags, and a model's config.toml
replacing the server's way of counting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from serving.repository.model_config import model_settings, read_model_config
from serving.settings.config import ConfigError, load_settings
from tests.serving.repository.test_model_config import model_dir, version


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("given", "start", "bounds"),
    [
        ({}, 1, (1, 1)),
        ({"replicas": 3}, 3, (3, 3)),
        ({"min_replicas": 2, "max_replicas": 4}, 2, (2, 4)),  # starts at its minimum
        ({"max_replicas": 4}, 1, (1, 4)),
        ({"min_replicas": 2}, 2, (2, 2)),
        ({"replicas": 2, "max_replicas": 4}, 2, (2, 4)),
        ({"replicas": 3, "min_replicas": 2, "max_replicas": 4}, 3, (2, 4)),
    ],
)
def test_bounds_and_the_count_a_version_starts_at(
    given: dict[str, int], start: int, bounds: tuple[int, int]
) -> None:
    settings = load_settings(**given)
    assert (settings.replicas, settings.replica_bounds()) == (start, bounds)
    assert settings.elastic == (bounds[0] < bounds[1])


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"min_replicas": 3, "max_replicas": 2},
            "min_replicas (3) is above max_replicas (2); give min <= max",
        ),
        (
            {"replicas": 5, "max_replicas": 4},
            "replicas (5) is outside min_replicas..max_replicas (4..4); --replicas N alone is a "
            "fixed count",
        ),
        ({"replicas": 2, "min_replicas": 3}, "replicas (2) is outside"),
        ({"max_replicas": 0}, "max_replicas: Input should be greater than or equal to 1"),
        ({"target_queue_wait_ms": 0}, "target_queue_wait_ms: Input should be greater than 0"),
    ],
)
def test_a_conflicting_count_is_refused_naming_the_values_and_the_fix(
    given: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_settings(**given)


def test_the_flags_and_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    from serving.cli import main

    seen = {}
    monkeypatch.setattr("serving.cli.serve.run_server", lambda s: seen.setdefault("s", s))
    monkeypatch.setenv("SHARDSERVE_DOWNSCALE_DELAY_S", "120")
    result = CliRunner().invoke(
        main.app,
        [
            *("serve", "--min-replicas", "1", "--max-replicas", "3"),
            *("--target-queue-wait-ms", "20", "--upscale-delay-s", "2", "--drain-timeout-s", "9"),
            *("--replica-pending-timeout-s", "60"),
        ],
    )
    assert result.exit_code == 0, result.output
    s = seen["s"]
    assert (s.replica_bounds(), s.target_queue_wait_ms, s.upscale_delay_s) == ((1, 3), 20.0, 2.0)
    assert (s.downscale_delay_s, s.drain_timeout_s, s.replica_pending_timeout_s) == (120, 9, 60)

    bad = CliRunner().invoke(main.app, ["serve", "--replicas", "4", "--max-replicas", "2"])
    assert bad.exit_code == 2
    assert "replicas (4) is outside min_replicas..max_replicas" in bad.output


@pytest.mark.parametrize(
    ("server", "toml", "start", "bounds"),
    [
        ({"replicas": 3}, "min_replicas = 1\nmax_replicas = 2\n", 1, (1, 2)),
        ({"replicas": 3}, "max_replicas = 6\n", 1, (1, 6)),
        ({"min_replicas": 1, "max_replicas": 4}, "replicas = 2\n", 2, (2, 2)),
        ({"min_replicas": 1, "max_replicas": 4}, "min_replicas = 2\n", 2, (2, 4)),
        ({"min_replicas": 1, "max_replicas": 4}, "", 1, (1, 4)),
    ],
)
def test_a_models_config_replaces_the_servers_way_of_counting(
    tmp_path: Path, server: dict[str, int], toml: str, start: int, bounds: tuple[int, int]
) -> None:
    path = model_dir(tmp_path, toml)
    base = load_settings(model_repository=tmp_path, **server)
    served = model_settings(base, "resnet", version(tmp_path), read_model_config(path))
    assert (served.replicas, served.replica_bounds()) == (start, bounds)
