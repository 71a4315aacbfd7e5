"""The README is the front page: its two commands are CI's and the Makefile's, and it stays short;
the settings reference (docs/settings.md) is what its generator writes from the settings model."""

import re
from pathlib import Path

import pytest

from serving.settings import reference
from serving.settings.config import Settings
from serving.settings.flags import flag_name

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SETTINGS_DOC = (ROOT / "docs" / "settings.md").read_text()


def test_settings_reference_is_what_its_generator_writes() -> None:
    assert reference.PATH == ROOT / "docs" / "settings.md"
    assert reference.render() == SETTINGS_DOC, (
        "docs/settings.md is stale: run `python -m serving.settings.reference`"
    )


@pytest.mark.parametrize("field", sorted(Settings.model_fields))
def test_every_setting_is_in_the_table(field: str) -> None:
    row = next(
        (line for line in SETTINGS_DOC.splitlines() if line.startswith(f"| `{field}` |")), None
    )
    assert row is not None, f"docs/settings.md has no row for {field}"
    assert f"`SHARDSERVE_{field.upper()}`" in row
    assert f"`{flag_name(field)}`" in row


def test_the_reference_shows_a_default_as_a_user_writes_it() -> None:
    rows = {
        m[0]: m[1] for m in re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", SETTINGS_DOC, re.MULTILINE)
    }
    assert rows["max_body_bytes"] == "16777216 (16 MiB)"
    assert rows["cache_dir"] == "~/.cache/shardserve"  # not this machine's home
    assert rows["model_name"] == "unset"
    assert rows["unsafe_deserialization"] == "false"


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "make test"
    assert "```bash\nmake test\n```" in README
    assert "```bash\nmake serve\n```" in README
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve: ", makefile, re.MULTILINE)
    assert re.search(r"^test: ", makefile, re.MULTILINE)


def test_the_readme_is_a_front_page_and_the_reference_lives_in_docs() -> None:
    assert len(README.splitlines()) <= 200, (
        "move reference text to docs/ (README: one screen or three)"
    )
    assert "| `max_batch_size` |" not in README, "the settings table lives in docs/settings.md"


def test_the_generator_writes_the_reference_and_check_finds_it_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = tmp_path / "settings.md"
    monkeypatch.setattr(reference, "PATH", page)
    assert reference.main(["--check"]) == 1  # not written yet
    assert reference.main([]) == 0
    assert page.read_text() == reference.render()
    assert reference.main(["--check"]) == 0
    page.write_text(page.read_text().replace("| `port` |", "| `prt` |"))
    assert reference.main(["--check"]) == 1
