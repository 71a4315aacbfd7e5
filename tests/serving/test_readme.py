"""The README is the user's manual: its settings table and quick start must match the code."""

from pathlib import Path

import pytest

from serving.cli.serve import flag_name
from serving.settings.config import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("field", sorted(Settings.model_fields))
def test_every_setting_is_in_the_table(field: str) -> None:
    row = next((line for line in README.splitlines() if line.startswith(f"| `{field}` |")), None)
    assert row is not None, f"README settings table has no row for {field}"
    assert f"`SHARDSERVE_{field.upper()}`" in row
    assert f"`{flag_name(field)}`" in row


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == "make test"
    assert "```bash\nmake test\n```" in README
    assert "```bash\nmake serve\n```" in README
