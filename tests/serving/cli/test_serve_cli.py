"""``shardserve serve``'s flags reach the settings: a repeatable flag per item, a boolean switch
with its ``--no-`` form, and a flag not given leaves the env var's value."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from serving.cli import serve as serve_cli
from serving.cli.main import app
from serving.config import Settings


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    got: list[Settings] = []
    monkeypatch.setattr(serve_cli, "run_server", got.append)
    return got


def test_length_padding_flags(served: list[Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["serve", "--no-pad-lengths", "--pad-input", "mask=false", "--pad-input", "ids=0"]
    result = CliRunner().invoke(app, [*args, "--allowed-lengths", "32,16"])
    assert result.exit_code == 0, result.output
    assert (served[0].pad_lengths, served[0].pad_inputs, served[0].allowed_lengths) == (
        False,
        {"mask": False, "ids": 0},
        [16, 32],
    )
    monkeypatch.setenv("SHARDSERVE_PAD_INPUTS", "ids=1")
    result = CliRunner().invoke(app, ["serve", "--pad-lengths"])
    assert result.exit_code == 0, result.output
    assert (served[1].pad_lengths, served[1].pad_inputs) == (True, {"ids": 1})


def test_a_bad_pad_input_is_refused_naming_it(served: list[Settings]) -> None:
    result = CliRunner().invoke(app, ["serve", "--pad-input", "mask"])
    assert result.exit_code == 2
    assert "expected NAME=VALUE" in result.output and "'mask'" in result.output
    assert not served
