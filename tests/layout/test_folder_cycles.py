"""No import cycle inside a folder, counting the imports made only for type checking.

import-linter skips ``if TYPE_CHECKING:`` imports (``exclude_type_checking_imports``: a name used
only in annotations is no import at run time), so two modules that need each other can hide a
circle behind one. A circle inside a folder is two ideas that are really one, or one that should
hand the other a ``Protocol``: this test finds them, with the imports that close each circle."""

from __future__ import annotations

import grimp
import pytest

FOLDERS_OF = ("serving", "shards")


def _graph() -> grimp.ImportGraph:
    # No cache: grimp's cache can hold a graph older than the files.
    return grimp.build_graph(*FOLDERS_OF, exclude_type_checking_imports=False, cache_dir=None)


def _folder(module: str) -> str:
    return module.rsplit(".", 1)[0]


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Circles among the modules of one folder (each folder's own modules, not its subfolders)."""
    found: list[list[str]] = []
    by_folder: dict[str, set[str]] = {}
    for module in graph.modules:
        by_folder.setdefault(_folder(module), set()).add(module)
    for modules in by_folder.values():
        edges = {
            m: {i for i in graph.find_modules_directly_imported_by(m) if i in modules}
            for m in modules
        }
        found.extend(_strongly_connected(edges))
    return found


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module (or one that imports itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_folder_holds_an_import_cycle() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "modules of one folder that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_the_cycle_finder_finds_circles_and_only_them(
    edges: dict[str, set[str]], expected: list[list[str]]
) -> None:
    assert _strongly_connected(edges) == expected
