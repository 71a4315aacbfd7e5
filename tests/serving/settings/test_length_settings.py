"""The length-padding settings: buckets, opt-in pad values and the switch, from every source,
with errors that name the bad value."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from serving.settings.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SHARDSERVE_")]:
        monkeypatch.delenv(name)


def test_defaults_pad_where_safe_with_no_opt_in_and_default_buckets() -> None:
    s = load_settings()
    assert (s.pad_lengths, s.allowed_lengths, s.pad_inputs) == (True, None, {})


def test_allowed_lengths_are_sorted_and_distinct() -> None:
    assert load_settings(allowed_lengths="64,16,32,16").allowed_lengths == [16, 32, 64]
    assert load_settings(allowed_lengths=[8, 512]).allowed_lengths == [8, 512]


def test_pad_values_parse_as_int_float_or_bool() -> None:
    s = load_settings(pad_inputs=["token_ids=0", "mask=false", "scale=0.5,offset=-1"])
    assert s.pad_inputs == {"token_ids": 0, "mask": False, "scale": 0.5, "offset": -1}
    assert [type(v) for v in s.pad_inputs.values()] == [int, bool, float, int]


def test_env_and_toml_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDSERVE_PAD_INPUTS", "ids=0,mask=False")
    monkeypatch.setenv("SHARDSERVE_ALLOWED_LENGTHS", "32,8")
    monkeypatch.setenv("SHARDSERVE_PAD_LENGTHS", "false")
    s = load_settings()
    assert (s.pad_inputs, s.allowed_lengths, s.pad_lengths) == (
        {"ids": 0, "mask": False},
        [8, 32],
        False,
    )
    monkeypatch.setenv("SHARDSERVE_PAD_INPUTS", '{"ids": 1, "mask": true}')
    assert load_settings().pad_inputs == {"ids": 1, "mask": True}
    for name in ("SHARDSERVE_PAD_INPUTS", "SHARDSERVE_ALLOWED_LENGTHS", "SHARDSERVE_PAD_LENGTHS"):
        monkeypatch.delenv(name)
    cfg = tmp_path / "s.toml"
    cfg.write_text("allowed-lengths = [16, 64]\n[pad_inputs]\nids = 0\nmask = false\n")
    s = load_settings(cfg)
    assert (s.allowed_lengths, s.pad_inputs) == ([16, 64], {"ids": 0, "mask": False})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            {"allowed_lengths": "16,1024", "max_sequence_length": "512"},
            "between 1 and max_sequence_length (512), got [16, 1024]; out of range: [1024]",
        ),
        (
            {"allowed_lengths": "64", "max_sequence_length": "32"},
            "max_sequence_length (32), got [64]",
        ),
        ({"allowed_lengths": "0,8"}, "out of range: [0]"),
        ({"allowed_lengths": "16,long"}, "allowed_lengths.1: Input should be a valid integer"),
        ({"pad_inputs": ["mask"]}, "expected NAME=VALUE (an input's name and its pad value), got"),
        ({"pad_inputs": ["=0"]}, "got '=0'"),
        (
            {"pad_inputs": ["mask=maybe"]},
            "the pad value of input 'mask' must be an int, a finite float or true/false, "
            "got 'maybe'",
        ),
        ({"pad_inputs": ["x=nan"]}, "got 'nan'"),
    ],
)
def test_bad_values_are_named(overrides: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(**overrides)
    assert expected in str(info.value)
