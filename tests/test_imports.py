"""The package's shape: no import cycles between minillama's modules, and no module over 450 lines.

The graph is read from the source with `ast` (nothing is imported): an edge for every `import` and
`from ... import` of a minillama module, those inside functions included (a lazy import hides a cycle, it
does not remove it), and those under `if TYPE_CHECKING:` too (they never run, but a reader of either
module still has to hold the other). `from P import name` is an edge to P.name where that is a module,
else to P. Imports under `if __name__ == "__main__":` are left out: that block runs only when the file is
the program, never when another module imports it. A parent package that Python initializes on the way to
a submodule is not an edge (a package's `__init__` re-exporting its submodules is no cycle); naming the
package itself is, except for a dunder (`from . import __doc__`): the import system sets those before the
package's body runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minillama"
MAX_LINES = 450


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_main_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":`"""
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "__name__"
            and len(t.comparators) == 1 and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def _imports(node: ast.AST):
    """Every Import / ImportFrom below `node` (`if TYPE_CHECKING:` blocks included), skipping
    `if __name__ == "__main__":` blocks."""
    for child in ast.iter_child_nodes(node):
        if _is_main_block(child):
            yield from (n for stmt in child.orelse for n in _imports_of(stmt))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _imports(child)


def _imports_of(stmt: ast.AST):
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        yield stmt
    yield from _imports(stmt)


def import_graph(root: Path, top: str = "minillama") -> dict[str, set[str]]:
    """Module -> the modules of `top` it imports. `root` holds the package directory `top`."""
    files = {module_name(p, root): p for p in sorted((root / top).rglob("*.py"))}
    packages = {module_name(p, root) for p in files.values() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        here = name if name in packages else name.rpartition(".")[0]  # what `from .` means in this file
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                           if not (a.name.startswith("__") and a.name.endswith("__"))]
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None when it is acyclic (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and graph["minillama.cli"]  # the graph was read, edges and all
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def too_long(root: Path, top: str = "minillama") -> dict[str, int]:
    """Modules over MAX_LINES, with their lengths."""
    lengths = {p.relative_to(root).as_posix(): len(p.read_text().splitlines()) for p in (root / top).rglob("*.py")}
    return {p: n for p, n in sorted(lengths.items()) if n > MAX_LINES}


def test_no_module_is_over_450_lines():
    grown = too_long(ROOT)
    assert not grown, f"modules over {MAX_LINES} lines (split them by concern): {grown}"


# --- negative controls: the checks see what they are meant to see -----------------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_cycle_is_found(tmp_path):
    root = _write(tmp_path, {
        "minillama/__init__.py": "from .api import load\n",
        "minillama/api.py": "def load():\n    from .oracle import record\n",  # lazy: still an edge
        "minillama/oracle/__init__.py": "",
        "minillama/oracle/record.py": "from .backends import Backend\n",
        "minillama/oracle/backends.py": "import torch\n\ndef f():\n    from minillama.oracle.record import Q\n",
    })
    graph = import_graph(tmp_path)
    assert graph["minillama.api"] == {"minillama.oracle.record"}
    assert find_cycle(graph) == ["minillama.oracle.record", "minillama.oracle.backends", "minillama.oracle.record"]
    # The cycle removed (the shared type moved to a third module both import), the graph is acyclic.
    _write(root, {"minillama/oracle/backends.py": "from .schema import Q\n", "minillama/oracle/schema.py": "Q = 1\n"})
    assert find_cycle(import_graph(tmp_path)) is None


def test_a_main_block_is_not_an_edge_but_everything_else_is(tmp_path):
    _write(tmp_path, {
        "minillama/__init__.py": "",
        "minillama/cli.py": "from . import generate\n",
        "minillama/generate.py": ("import minillama.weights\nif __name__ == '__main__':\n    from . import cli\n"
                                  "else:\n    from .weights import hf\n"),
        "minillama/weights/__init__.py": "from .hf import read\n",
        "minillama/weights/hf.py": "from minillama.weights import read\n",  # the package itself: an edge
        "minillama/weights/load.py": "from . import __doc__\n",  # set before the package's body: no edge
    })
    graph = import_graph(tmp_path)
    assert graph["minillama.generate"] == {"minillama.weights", "minillama.weights.hf"}
    assert graph["minillama.weights.hf"] == {"minillama.weights"} and graph["minillama.weights.load"] == set()
    assert find_cycle(graph) == ["minillama.weights", "minillama.weights.hf", "minillama.weights"]


def test_a_type_checking_block_is_an_edge(tmp_path):
    _write(tmp_path, {
        "minillama/__init__.py": "",
        "minillama/attention.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import Items\n",
        "minillama/plan.py": "from .blocks import visible_blocks\n",
        "minillama/blocks.py": "",
    })
    graph = import_graph(tmp_path)
    assert graph["minillama.attention"] == {"minillama.plan"} and find_cycle(graph) is None
    _write(tmp_path, {"minillama/plan.py": "from .attention import visible_blocks\n"})  # the arrow back: a cycle
    assert find_cycle(import_graph(tmp_path)) == ["minillama.attention", "minillama.plan", "minillama.attention"]


def test_a_long_module_is_refused(tmp_path):
    _write(tmp_path, {"minillama/__init__.py": "", "minillama/ok.py": "x = 1\n" * MAX_LINES,
                      "minillama/big.py": "x = 1\n" * (MAX_LINES + 1), "minillama/cli.py": "x = 1\n" * 500})
    assert too_long(tmp_path) == {"minillama/big.py": MAX_LINES + 1, "minillama/cli.py": 500}
