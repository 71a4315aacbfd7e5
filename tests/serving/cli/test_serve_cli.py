"""``shardserve serve``'s flags reach the settings: a repeatable flag per item, a boolean switch
with its ``--no-`` form, and a flag not given leaves the env var's value."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from serving.cli import serve as serve_cli
from serving.cli.main import app
from serving.settings.config import Settings


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


def test_repository_flags(served: list[Settings], tmp_path: Path) -> None:
    args = ["serve", "--model-repository", str(tmp_path), "--default-model", "resnet"]
    result = CliRunner().invoke(app, [*args, "--repository-poll-s", "2.5"])
    assert result.exit_code == 0, result.output
    settings = served[0]
    assert (settings.model_repository, settings.default_model, settings.repository_poll_s) == (
        tmp_path,
        "resnet",
        2.5,
    )


def test_a_model_and_a_repository_together_are_refused(
    served: list[Settings], tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        app, ["serve", "--model", "demo-tiny", "--model-repository", str(tmp_path)]
    )
    assert result.exit_code == 2
    assert "give either model ('demo-tiny') or model_repository" in result.output
    assert not served


def test_an_admin_token_on_the_command_line_is_warned_about(
    served: list[Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flag is in ps and /proc for every user of the machine (issue 37, item 10)."""
    result = CliRunner().invoke(app, ["serve", "--admin-token", "s3cret"])
    assert result.exit_code == 0, result.output
    assert "--admin-token on the command line is visible to every user of this machine" in (
        " ".join(result.output.split())
    )
    monkeypatch.setenv("SHARDSERVE_ADMIN_TOKEN", "s3cret")
    quiet = CliRunner().invoke(app, ["serve"])
    assert quiet.exit_code == 0, quiet.output
    assert "warning" not in quiet.output
    assert [s.admin_token.get_secret_value() for s in served if s.admin_token] == ["s3cret"] * 2


def test_the_lookup_combine_flag_reaches_the_settings_and_a_bad_one_names_the_choices(
    served: list[Settings],
) -> None:
    result = CliRunner().invoke(app, ["serve", "--lookup-combine", "dense"])
    assert result.exit_code == 0, result.output
    assert served[0].lookup_combine == "dense"
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0
    assert served[1].lookup_combine == "routed"  # the default
    bad = CliRunner().invoke(app, ["serve", "--lookup-combine", "sparse"])
    assert bad.exit_code == 2
    assert "lookup_combine: Input should be 'routed' or 'dense' (got 'sparse')" in bad.output
    assert len(served) == 2
