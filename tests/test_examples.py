"""examples/ask.py from a fresh clone: no install, no PYTHONPATH, run from another directory; it answers the
shipped questions as examples/README.md says (the default model, so marked slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_ask_runs_from_a_fresh_clone(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "ask.py")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr
    expected = dict(re.findall(r"^\| (.+\?) \| (.+) \|$", (ROOT / "examples" / "README.md").read_text(), re.M))
    answers = dict(re.findall(r"^Q: (.*)\nA: (.*?)  \(", p.stdout, re.M))
    assert len(expected) == 5 and answers == expected, p.stdout
