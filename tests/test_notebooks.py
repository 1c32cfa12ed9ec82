"""Every notebook in notebooks/ runs top to bottom, the way a reader runs it: from notebooks/, offline.

The notebooks assert what they teach (parallel answers bit-equal to independent ones, cached decoding equal
to recomputation, ...), so a broken claim fails here, not only a broken cell. The real-model notebooks load
the default model (fetched and converted on first use), hence `slow`: it still runs in CI.

The committed notebooks carry their outputs. To refresh them after a change, run this file:

    python tests/test_notebooks.py                 # every notebook
    python tests/test_notebooks.py 06_bit_parity   # some of them
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 900


def execute(path: Path) -> nbformat.NotebookNode:
    """Run the notebook at `path` in a fresh python3 kernel with notebooks/ as its working directory."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def test_notebooks_exist():
    assert len(PATHS) >= 7, [p.name for p in PATHS]


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs(path: Path):
    execute(path)


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
