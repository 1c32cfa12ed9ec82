"""The README and the docs stay true: every ```python block of README.md and docs/*.md runs as written (from
the repository root, as a user of a clone would run it), and the README's performance table is exactly what
the bench renders from docs/bench/results.json, never a hand copy."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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
