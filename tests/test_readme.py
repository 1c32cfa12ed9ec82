"""The README stays true: every ```python block runs as written (from the repository root, as a user of a
clone would run it), and the performance table is exactly what the bench renders from
docs/bench/results.json, never a hand copy."""

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
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, re.M | re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.slow  # the blocks use the default model
@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_python_block_runs(i, tmp_path):
    script = tmp_path / f"block{i}.py"
    script.write_text(BLOCKS[i])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=1200)
    assert p.returncode == 0, f"README python block {i} failed:\n{BLOCKS[i]}\n{p.stderr}"


def test_performance_table_is_rendered_from_the_results():
    data = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    assert README.count(README_START) == 1 and README.count(README_END) == 1
    shown = README.split(README_START)[1].split(README_END)[0].strip()
    assert shown == readme_table(data), "regenerate: python -m minillama.bench --from-json " \
                                        "docs/bench/results.json --readme README.md"
