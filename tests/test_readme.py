"""The README and the docs stay true: every ```python block of README.md and docs/*.md runs as written (from
the repository root, as a user of a clone would run it), and the README's performance table is exactly what
the bench renders from docs/bench/results.json, never a hand copy."""

from __future__ import annotations

import ast
import collections
import functools
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minillama.bench.report import README_END, README_START, readme_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


BLOCKS = [(page.relative_to(ROOT).as_posix(), i, block)
          for page in PAGES for i, block in enumerate(python_blocks(page.read_text()))]


def test_the_readme_and_the_docs_have_python_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert len(python_blocks(README)) >= 1 and {"docs/design.md", "docs/oracle.md"} <= pages, pages


def test_the_block_finder_sees_every_fenced_python_block():
    """A block the pattern misses would go untested: count the opening fences apart."""
    for page in PAGES:
        text = page.read_text()
        assert len(python_blocks(text)) == len(re.findall(r"^```python$", text, re.M)), page


def slug(heading: str) -> str:
    """A heading's anchor as the code host writes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_exists():
    """The README points into docs/ for everything it no longer holds: a moved page or a renamed section
    must not leave a dead link behind."""
    dead = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", dest.read_text(), re.M)
                if anchor not in {slug(h) for h in headings}:
                    dead.append(f"{page.relative_to(ROOT)}: {target} (no such section)")
    assert not dead, "\n".join(dead)


# --- docs/design.md's map of the code names only what the code has ---------------------------------------

MAP_HEADING = "## 8. A map of the code"
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")  # module.name, Class.name, module.Class.name, ...


@functools.cache
def _modules(root: Path) -> dict[str, str]:
    """Each module's dotted path below minillama ("generate", "distributed.tp"), and its last part too where
    that is one module's alone ("tp"): what the map writes before a name."""
    paths = [p.relative_to(root / "minillama").with_suffix("").parts for p in (root / "minillama").rglob("*.py")]
    dotted = [d for d in (".".join(p[:-1] if p[-1] == "__init__" else p) for p in paths) if d]
    tails = collections.Counter(d.rpartition(".")[2] for d in dotted)
    return {**{d.rpartition(".")[2]: d for d in dotted if tails[d.rpartition(".")[2]] == 1}, **{d: d for d in dotted}}


@functools.cache
def _classes(root: Path) -> dict[str, str]:
    """Class name -> the module (dotted, below minillama) that defines it, for names only one module defines."""
    found: dict[str, list[str]] = {}
    for name, module in _modules(root).items():
        if name != module:
            continue
        path = root / "minillama" / (module.replace(".", "/") + ".py")
        path = path if path.exists() else path.with_suffix("") / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(module)
    return {name: where[0] for name, where in found.items() if len(where) == 1}


def _has(obj: object, name: str) -> bool:
    """obj.name, counting a dataclass's fields and what a class's own methods assign to self.name."""
    if hasattr(obj, name) or name in getattr(obj, "__dataclass_fields__", {}):
        return True
    if not isinstance(obj, type):
        return False
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    return any(isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr == name
               and isinstance(n.value, ast.Name) and n.value.id == "self" for n in ast.walk(tree))


def _resolves(name: str, root: Path) -> bool | None:
    """Whether `name` (`generate._run`, `cache.KVCache.append`, `KVCache.chain`) is there; None where it does
    not start with a minillama module or class (`torch.mm`, an instance such as `kernels.comm`)."""
    parts = name.split(".")
    modules, classes = _modules(root), _classes(root)
    for i in range(len(parts), 0, -1):  # the longest module prefix (serve.engine.Engine: serve.engine)
        if ".".join(parts[:i]) in modules:
            obj, rest = importlib.import_module("minillama." + modules[".".join(parts[:i])]), parts[i:]
            break
    else:
        if parts[0] not in classes:
            return None
        obj, rest = getattr(importlib.import_module("minillama." + classes[parts[0]]), parts[0]), parts[1:]
    for part in rest:
        if not _has(obj, part):
            return False
        obj = getattr(obj, part, None)
    return True


def dead_map_references(text: str, root: Path = ROOT) -> list[str]:
    """What docs/design.md's map of the code names that the repository does not have, and the modules it
    leaves out. The tree: each entry (`config.py`, `distributed/`, `notebooks/`) and each file its line names
    (`(tp.py)`), and every module and package of minillama/ listed. The paths through it: each backticked
    path (`tests/test_imports.py`) and each `module.name` or `Class.name` of minillama, up to a call's `(`
    or a ` = `: `generate._run`, `serve.engine.Engine`, `KVCache.new_segment(parent)`."""
    section = text.split(MAP_HEADING, 1)[1].split("\n## ", 1)[0]
    tree = re.search(r"^```\n(.*?)^```$", section, re.M | re.S).group(1)
    dead, listed, under = [], set(), root
    files = {p.name for p in (root / "minillama").rglob("*.py")}
    for line in tree.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        m = re.match(r" *((?:[\w.]+(?:\.py|/),? )+)", line) if indent in (0, 2) else None  # entries, then what
        entries = [e.rstrip(",") for e in m.group(1).split()] if m else []
        if entries:
            under = root if indent == 0 else root / "minillama"
            listed.update(e.rstrip("/").removesuffix(".py") for e in entries if indent == 2)
        dead += [f"tree: {e}" for e in entries if not (under / e).exists()]
        for file in re.findall(r"[\w/]+\.(?:py|md)", line[m.end():] if m else line):  # (tp.py), (notebooks/README.md)
            if not ((root / file).exists() or (root / "minillama" / file).exists() or file in files):
                dead.append(f"tree: {file}")
    package = {p.stem for p in (root / "minillama").glob("*.py")} | {
        p.parent.name for p in (root / "minillama").glob("*/__init__.py")}
    dead += [f"tree: minillama/{m} is not in the map" for m in sorted(package - listed - {"__init__"})]
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```$", "", section, flags=re.M | re.S)):
        head = re.split(r"[( =]", span, maxsplit=1)[0]
        if "/" in head or head.endswith((".py", ".md")):
            if not (root / head).exists():
                dead.append(f"path: {span}")
        elif NAME.fullmatch(head) and _resolves(head, root) is False:
            dead.append(f"name: {span}")
    return dead


def test_the_map_of_the_code_names_what_the_code_has():
    text = (ROOT / "docs" / "design.md").read_text()
    assert MAP_HEADING in text and "`generate._run`" in text  # the section is there and read
    dead = dead_map_references(text)
    assert not dead, "docs/design.md's map of the code:\n" + "\n".join(dead)


def test_a_dead_reference_in_the_map_is_found():
    """The negative control: a renamed function, a renamed method, a moved test, a tree entry and a file named
    in the tree that do not exist, and a module left out of the tree are each reported, and nothing else."""
    text = (ROOT / "docs" / "design.md").read_text()
    planted = (text.replace("`generate._run`", "`generate._run_pieces`")
               .replace("`KVCache.chain_slots`", "`KVCache.chain_slot`")
               .replace("`tests/test_signatures.py`", "`tests/test_signature.py`")
               .replace("  rope.py  ", "  ropes.py ")
               .replace("(launch.py)", "(launcher.py)"))
    planted = re.sub(r"^  threads\.py .*\n", "", planted, flags=re.M)
    assert sorted(dead_map_references(planted)) == sorted([
        "name: generate._run_pieces", "name: KVCache.chain_slot", "path: tests/test_signature.py",
        "tree: ropes.py", "tree: launcher.py", "tree: minillama/rope is not in the map",
        "tree: minillama/threads is not in the map"])
    assert _resolves("torch.mm", ROOT) is None and _resolves("kernels.comm", ROOT) is None  # not minillama's


def test_the_docs_cite_nothing_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        for outside in ("NOTES" + ".md", "../shared", "/work/", "/tmp/"):  # spelled apart: the repository names neither
            assert outside not in text, f"{page.relative_to(ROOT)} mentions {outside}"


def test_the_readme_stays_short():
    """The README says what minillama is and how to start; the rest lives in docs/."""
    assert README.count("\n") <= 250, "move detail into docs/ and link it"


@pytest.mark.slow  # the blocks use the default model
@pytest.mark.parametrize("page, i, block", BLOCKS, ids=[f"{page}:{i}" for page, i, _ in BLOCKS])
def test_python_block_runs(page, i, block, tmp_path):
    script = tmp_path / f"block{i}.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=1200)
    assert p.returncode == 0, f"{page} python block {i} failed:\n{block}\n{p.stderr}"


def test_performance_table_is_rendered_from_the_results():
    data = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    assert README.count(README_START) == 1 and README.count(README_END) == 1
    shown = README.split(README_START)[1].split(README_END)[0].strip()
    assert shown == readme_table(data), "regenerate: python -m minillama.bench --from-json " \
                                        "docs/bench/results.json --readme README.md"


def test_the_quick_start_is_two_commands_and_ci_runs_the_second():
    """A newcomer finds at the top two commands: one that installs and answers the example questions, one
    that installs the test dependencies and passes the tests; CI runs exactly the second."""
    section = README.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^## (.*)$", README, re.M)[0] == "Quick start", "the first section"
    commands = re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S)
    assert len(commands) == 1, "one block"
    lines = commands[0].strip().splitlines()
    assert len(lines) == 2 and "minillama generate" in lines[0] and "pytest" in lines[1], lines
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == lines[1], (ci[-1], lines[1])
