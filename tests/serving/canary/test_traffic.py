"""[traffic] and [canary] in a model's config.toml: the values read, the defaults, and errors
that name the file, the table, the key and what is allowed."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from serving.canary.config import CanaryConfig, TrafficConfig, read_traffic
from serving.repository.model_config import read_model_config
from serving.settings.config import ConfigError

WHERE = "resnet/config.toml"


def read(toml: str) -> TrafficConfig | None:
    return read_traffic(tomllib.loads(toml), WHERE)


def refused(toml: str) -> str:
    with pytest.raises(ConfigError) as caught:
        read(toml)
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: ") and "\n" not in message
    return message


def test_no_traffic_table_is_no_canary() -> None:
    assert read("") is None
    assert read("[versions]\nn = 2\n") is None


def test_the_issues_example_is_read_as_written() -> None:
    config = read(
        """
        [traffic]
        stable = 90
        canary = 10
        [canary]
        window_s = 60
        min_requests = 100
        error_margin = 0.02
        latency_factor = 2.0
        promote = "auto"
        """
    )
    assert config == TrafficConfig(
        stable=90,
        canary=10,
        canary_rules=CanaryConfig(
            window_s=60, min_requests=100, error_margin=0.02, latency_factor=2.0, promote="auto"
        ),
    )


def test_traffic_without_canary_takes_the_default_rules_and_dashes_are_read() -> None:
    config = read("[traffic]\nstable = 95\ncanary = 5\n[canary]\nmin-requests = 20\n")
    assert config is not None
    assert (config.stable, config.canary) == (95, 5)
    assert config.canary_rules == CanaryConfig(min_requests=20)
    assert read("[traffic]\ncanary = 10\n") == TrafficConfig(stable=100, canary=10)
    assert CanaryConfig().promote == "manual"


def test_canary_without_traffic_is_refused() -> None:
    message = refused("[canary]\nwindow_s = 30\n")
    assert "[canary] needs a [traffic] table" in message


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ("[traffic]\nstabel = 90\n", "unknown key 'stabel' in [traffic]; allowed: ['stable', "),
        ("[traffic]\n[canary]\nwindow = 60\nmax_p99 = 1\n", "unknown keys 'window', 'max_p99'"),
        ("[traffic]\nstable = -1\n", "[traffic] stable must be an integer weight >= 0, got -1"),
        ("[traffic]\ncanary = 0.5\n", "[traffic] canary must be an integer weight >= 0, got 0.5"),
        ("[traffic]\ncanary = true\n", "canary must be an integer weight >= 0, got True"),
        ("[traffic]\nstable = 0\ncanary = 0\n", "both 0: at least one weight must be > 0"),
        ("[traffic]\n[canary]\nwindow_s = 0\n", "[canary] window_s must be a number of seconds"),
        ("[traffic]\n[canary]\nwindow_s = inf\n", "window_s must be a number of seconds > 0"),
        ("[traffic]\n[canary]\nmin_requests = 0\n", "[canary] min_requests must be an integer"),
        ("[traffic]\n[canary]\nmin_requests = 1.5\n", "min_requests must be an integer >= 1"),
        ("[traffic]\n[canary]\nerror_margin = 2\n", "error_margin must be a number from 0 to 1"),
        ("[traffic]\n[canary]\nlatency_factor = 0.5\n", "latency_factor must be a number >= 1"),
        ('[traffic]\n[canary]\npromote = "yes"\n', "promote must be one of ['manual', 'auto']"),
        ("traffic = 5\n", "traffic must be a table ([traffic]), got 5"),
    ],
)
def test_a_bad_value_names_the_file_the_key_and_what_is_allowed(toml: str, expected: str) -> None:
    assert expected in refused(toml)


def test_model_config_carries_the_traffic(tmp_path: Path) -> None:
    model = tmp_path / "resnet"
    model.mkdir()
    (model / "config.toml").write_text("[traffic]\nstable = 90\ncanary = 10\n")
    assert read_model_config(model).traffic == TrafficConfig(stable=90, canary=10)
    (model / "config.toml").write_text("max_batch_size = 8\n")
    assert read_model_config(model).traffic is None


def test_model_config_names_the_file_in_a_traffic_error(tmp_path: Path) -> None:
    model = tmp_path / "resnet"
    model.mkdir()
    (model / "config.toml").write_text('[traffic]\ncanary = 10\n[canary]\npromote = "now"\n')
    with pytest.raises(ConfigError, match=r"^resnet/config\.toml: \[canary\] promote must"):
        read_model_config(model)


def test_the_dataclasses_check_values_made_in_code_too() -> None:
    # The admin API builds weights from a request body: the same checks, as ValueError.
    bad: dict[str, Any] = {"stable": 1, "canary": -5}
    with pytest.raises(ValueError, match="canary must be an integer weight >= 0, got -5"):
        TrafficConfig(**bad)
