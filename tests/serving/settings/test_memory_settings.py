"""Memory budgets in the server's settings: units, one per device, from flags, env and TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.settings.config import ConfigError, load_settings

GiB = 2**30


def test_budgets_with_units_one_per_device() -> None:
    settings = load_settings(max_stage_bytes="16GiB,16GiB,40GB", device_overhead_bytes="1GiB")
    assert settings.max_stage_bytes == [16 * GiB, 16 * GiB, 40 * 10**9]
    assert settings.device_overhead_bytes == GiB


def test_budgets_from_env_and_toml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SHARDSERVE_MAX_STAGE_BYTES", "512MiB")
    assert load_settings().max_stage_bytes == [512 * 2**20]
    monkeypatch.delenv("SHARDSERVE_MAX_STAGE_BYTES")
    config = tmp_path / "s.toml"
    config.write_text('max_stage_bytes = ["8GiB", 1000]\ndevice_overhead_bytes = 0\n')
    settings = load_settings(config)
    assert settings.max_stage_bytes == [8 * GiB, 1000]
    assert settings.device_overhead_bytes == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"max_stage_bytes": "16 parsecs"}, "max_stage_bytes: cannot read '16 parsecs'"),
        ({"max_stage_bytes": "0"}, "max_stage_bytes: a byte size must be >= 1 byte"),
        ({"device_overhead_bytes": "lots"}, "device_overhead_bytes: cannot read 'lots'"),
        (
            {"max_stage_bytes": "1GiB,2GiB", "stage_resources": '[{"a": 1}, {"b": 1}, {"c": 1}]'},
            "max_stage_bytes lists 2 device budgets but stage_resources 3 stages",
        ),
    ],
)
def test_bad_budgets_are_refused_with_the_reason(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(**flags)
