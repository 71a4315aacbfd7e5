"""Rows reach the batcher through the data plane only: a protocol's work calls
``serving.protocols.dataplane.submit`` (or ``submit_ragged``), which holds them to the length the
model serves and the deadline to the client's own timeout, so that a new protocol cannot forget
either. No module of ``serving/protocols/`` but the data plane (and ``ragged.py``, which it calls)
calls a batcher's ``submit`` or ``submit_lengths``, nor the length check itself."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOCOLS = ROOT / "serving" / "protocols"
ALLOWED = {PROTOCOLS / "dataplane.py", PROTOCOLS / "ragged.py"}
BATCHER_CALLS = {"submit", "submit_lengths"}


def _calls(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in BATCHER_CALLS:
            found.append(f"{path.relative_to(root)}:{node.lineno} .{func.attr}(...)")
        if isinstance(func, ast.Attribute | ast.Name):
            name = func.attr if isinstance(func, ast.Attribute) else func.id
            if name.endswith("check_sequence_length"):
                found.append(f"{path.relative_to(root)}:{node.lineno} {name}(...)")
    return found


def test_only_the_data_plane_hands_rows_to_the_batcher() -> None:
    found = [hit for path in PROTOCOLS.rglob("*.py") if path not in ALLOWED for hit in _calls(path)]
    assert not found, "submit through serving.protocols.dataplane.submit:\n" + "\n".join(found)


def test_the_check_sees_a_direct_submit(tmp_path: Path) -> None:
    module = tmp_path / "work.py"
    module.write_text("async def work(batcher, rows):\n    return await batcher.submit(rows)\n")
    assert _calls(module, tmp_path) == ["work.py:2 .submit(...)"]
