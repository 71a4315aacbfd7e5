"""A served version's state has one home: its state machine (``serving.version.life``), written by
``ServedModel`` only. Outside ``serving/version/`` a module reads ``state``, ``reason``,
``condition()`` and ``was_ready``; it never reads the machine's fields, the version's private
fields, or the flags the state machine replaced (which would be a second vocabulary of state)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = ROOT / "serving" / "version"
# The machine and the fields it replaced: ``load_error``, ``refusing``, ``ready``/``loaded``
# events, ``batcher_failure``, ``load_waiting`` were four vocabularies of one state.
# (the machine's own fields are reachable only through ``_life``)
PRIVATE = {"_life", "_load_waits"}
REPLACED = {"load_error", "refusing", "load_waiting", "batcher_failure"}
MACHINE_ONLY = {"Life", "TRANSITIONS", "LOADING_STATES", "IllegalTransition"}


def _outside_version() -> list[Path]:
    return [p for p in (ROOT / "serving").rglob("*.py") if VERSION not in p.parents]


def _reads(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE | REPLACED:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module == "serving.version.life":
            for alias in node.names:
                if alias.name in MACHINE_ONLY:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
    return found


def test_no_module_outside_version_reads_a_versions_state_fields() -> None:
    found = [hit for path in _outside_version() for hit in _reads(path)]
    assert not found, "read the state through ServedModel.state/reason/condition():\n" + "\n".join(
        found
    )


def test_the_check_sees_a_read_it_must_refuse(tmp_path: Path) -> None:
    # The scan itself: a module that reads the old flag and the machine is caught.
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from serving.version.life import Life\n"
        "def f(model):\n    return model.load_error or model._life.state\n"
    )
    saved = globals()["ROOT"]
    globals()["ROOT"] = tmp_path
    try:
        hits = _reads(bad)
    finally:
        globals()["ROOT"] = saved
    assert len(hits) == 3, hits
