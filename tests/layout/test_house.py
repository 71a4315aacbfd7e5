"""The layout's rules that import-linter cannot say: how deep module-level imports chain inside
``serving/``, and how long a hand-written module may grow."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_CHAIN = 7
MAX_LINES = 350
# Generated gRPC stubs are not hand-written.
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    return {
        _module_name(p): p for p in (ROOT / package).rglob("*.py") if not p.name.endswith(GENERATED)
    }


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Imports run when the module is imported: not those inside functions or TYPE_CHECKING."""
    found: list[str] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body
        elif isinstance(node, (ast.With, ast.ClassDef)):
            todo += node.body
    return found


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _top_level_imports(ast.parse(path.read_bytes())):
            if imported in modules and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def longest_chain(package: str) -> list[str]:
    graph = _graph(package)

    @functools.cache
    def longest_from(name: str, stack: frozenset[str] = frozenset()) -> tuple[str, ...]:
        best: tuple[str, ...] = ()
        for target in graph[name]:
            if target in stack:
                continue  # a cycle: import-linter's contracts refuse those
            chain = longest_from(target, stack | {name})
            if len(chain) > len(best):
                best = chain
        return (name, *best)

    return list(max((longest_from(n) for n in graph), key=len))


def test_module_level_imports_inside_serving_chain_at_most_seven_modules() -> None:
    chain = longest_chain("serving")
    assert len(chain) <= MAX_CHAIN, " -> ".join(chain)


def test_the_chain_walker_sees_a_real_chain() -> None:
    # The app's module imports at least the server package, a protocol and the batcher below it.
    assert len(longest_chain("serving")) >= 3


def test_no_hand_written_module_is_over_350_lines() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for package in ("serving", "shards", "bench")
        for path in _modules(package).values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_architecture_doc_names_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        str(path.relative_to(ROOT))
        for package in ("serving", "shards")
        for path in _modules(package).values()
        if path.name != "__init__.py"
        and str(path.relative_to(ROOT)) not in doc
        and f"{path.stem}.py" not in doc
        and f"`{path.stem}`" not in doc
    ]
    assert not unnamed, f"docs/architecture.md does not name {unnamed}"
