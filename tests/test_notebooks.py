"""Every notebook in notebooks/ runs top to bottom, the way a reader runs it: from notebooks/, offline.

The notebooks assert what they teach (parallel answers bit-equal to independent ones, cached decoding equal
to recomputation, ...), so a broken claim fails here, not only a broken cell. The real-model notebooks load
the default model (fetched and converted on first use), hence `slow`: it still runs in CI.

The committed notebooks carry their outputs. A code cell tagged `same-output` prints the same text on every
machine (a configuration, a shape: no timing, no float bits of this machine's kernels); when the notebook is run
here, what it prints must be what the committed notebook shows, so a stale print fails. To refresh them after a
change, run this file:

    python tests/test_notebooks.py                 # every notebook
    python tests/test_notebooks.py 06_bit_parity   # some of them
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 900
SAME_OUTPUT = "same-output"  # the tag of a code cell whose printed text is the same on every machine


def execute(path: Path) -> nbformat.NotebookNode:
    """Run the notebook at `path` in a fresh python3 kernel with notebooks/ as its working directory."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def test_notebooks_exist():
    assert len(PATHS) >= 7, [p.name for p in PATHS]


def code_cells(path: Path) -> list[nbformat.NotebookNode]:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.get("name") == "stdout")


def same_output(cell: nbformat.NotebookNode) -> bool:
    return SAME_OUTPUT in cell.metadata.get("tags", [])


def test_cells_tagged_same_output_print_something():
    """The check of `test_notebook_runs` has cells to compare: each tagged cell prints (its stdout committed), and
    notebook 06's first cell, which prints the CPU tiles, is one (its print once went stale: no `long_rows`)."""
    tagged = {(p.stem, i) for p in PATHS for i, c in enumerate(code_cells(p)) if same_output(c)}
    assert ("06_bit_parity", 0) in tagged
    assert all(stdout(code_cells(NOTEBOOKS / f"{stem}.ipynb")[i]) for stem, i in tagged)


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_asserts_what_it_shows(path: Path):
    """A claim a notebook shows is checked where it is shown, so a broken claim fails the run, not only a
    broken cell: a third of the code cells at least (setup, pictures and timings need none)."""
    cells = code_cells(path)
    checked = [c for c in cells if any(line.lstrip().startswith("assert ") for line in c.source.splitlines())]
    assert 3 * len(checked) >= len(cells), f"{path.name}: {len(checked)} of {len(cells)} code cells assert"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_committed_notebook_carries_its_outputs(path: Path):
    """Notebooks are committed executed, top to bottom, with no error output (refresh: run this file)."""
    cells = code_cells(path)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), f"{path.name}: not executed in order"
    errors = [o.get("ename") for c in cells for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name}: {errors}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_cites_only_the_repository(path: Path):
    """Notebooks speak of minillama and its own files: no paths outside the checkout, in cells or outputs."""
    text = path.read_text(encoding="utf-8")
    for outside in ("NOTES" + ".md", "../shared", "/work/", "/tmp/"):  # spelled apart: the repository names neither
        assert outside not in text, f"{path.name} mentions {outside!r}"


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_first_cell_finds_the_checkout_from_any_folder_in_it(path: Path):
    """A reader's Jupyter may start a notebook's kernel in another folder of the checkout than notebooks/
    (the repository root, or deeper): the first cell finds the checkout from any of them and imports minillama
    from it. Run here from docs/bench, with nothing of the checkout on the path before the cell puts it there."""
    root = NOTEBOOKS.parent
    probe = "\nimport minillama\nprint(ROOT, minillama.__file__, sep='\\n')\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, "-P", "-c", code_cells(path)[0].source + probe], cwd=root / "docs" / "bench",
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, f"{path.name}: {p.stderr.strip().splitlines()[-1:]}"
    found, module = p.stdout.strip().splitlines()[-2:]
    assert Path(found) == root and Path(module).is_relative_to(root), (path.name, found, module)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path: Path):
    """It runs, and each cell tagged `same-output` prints what the committed notebook shows."""
    committed = code_cells(path)
    ran = [c for c in execute(path).cells if c.cell_type == "code"]
    stale = [i for i, (old, new) in enumerate(zip(committed, ran), 1)
             if same_output(old) and stdout(old) != stdout(new)]
    assert not stale, (f"{path.name}: code cells {stale} print other text than the committed notebook shows: refresh "
                       f"it (python tests/test_notebooks.py {path.stem})")


def main(names: list[str]) -> int:
    paths = [NOTEBOOKS / f"{Path(n).stem}.ipynb" for n in names] if names else PATHS
    total = 0.0
    for path in paths:
        t0 = time.perf_counter()
        nb = execute(path)
        dt = time.perf_counter() - t0
        total += dt
        nbformat.write(nb, path)
        print(f"{path.name}: {dt:.0f} s")
    print(f"total: {total:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
