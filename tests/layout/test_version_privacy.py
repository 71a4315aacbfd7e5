"""A served version's state has one home: its state machine (``serving.version.life``), written by
``ServedModel`` only. Outside ``serving/version/`` a module reads ``state``, ``reason``,
``phase``, ``condition()`` and the named questions ``takes_requests`` and ``available``; it never
reads the machine's fields, the version's private fields, or the flags the state machine replaced
(which would be a second vocabulary of state), nor keeps a predicate of its own."""

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


# "Is this version serving" has one answer: outside ``serving/version/`` a module asks the
# version's named questions (``takes_requests``: may it take a request; ``available``: is it
# counted as available; ``phase``: where it stands) or a protocol view that derives its words from
# them (the index's, ``serving/repository/index.py``; TF Serving's,
# ``serving/protocols/tfserving/status.py``). None keeps a predicate of its own: the old flags,
# the machine's states compared, ``not_ready_reason()`` compared with None, or a view's words.
OLD_QUESTIONS = {"serving", "was_ready"}
VIEW_WORDS = {"READY", "LOADING", "UNAVAILABLE", "AVAILABLE", "START", "UNLOADING", "END"}
VIEWS = {"serving/repository/index.py", "serving/protocols/tfserving/status.py"}


def _own_predicates(path: Path, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and node.attr in OLD_QUESTIONS:
            found.append(f"{line} .{node.attr}")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "VersionState"
        ):
            found.append(f"{line} VersionState.{node.attr}")
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            if (
                isinstance(side, ast.Call)
                and isinstance(side.func, ast.Attribute)
                and side.func.attr == "not_ready_reason"
            ):
                found.append(f"{line} not_ready_reason() compared")
            if isinstance(side, ast.Constant) and side.value in VIEW_WORDS and where not in VIEWS:
                found.append(f"{line} compares {side.value!r}")
    return found


def test_is_it_serving_has_one_answer_outside_version() -> None:
    found = [
        hit
        for path in _outside_version()
        if "proto" not in path.relative_to(ROOT).parts
        for hit in _own_predicates(path, path.relative_to(ROOT).as_posix())
    ]
    assert not found, (
        "ask ServedModel.takes_requests / .available / .phase, or a view:\n" + "\n".join(found)
    )


def test_the_check_sees_a_predicate_of_its_own(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(model, entry):\n"
        "    return (model.serving or model.was_ready or model.state is VersionState.READY\n"
        "            or model.not_ready_reason() is None or entry['state'] == 'READY')\n"
    )
    assert len(_own_predicates(bad, "bad.py")) == 5
