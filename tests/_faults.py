"""Shared by tests/test_faults.py and tests/test_faults_io.py: a tiny checkpoint and inputs, a tool run in
a fresh process (optionally with every write past a size failing as on a full disk), and the check that
a failure is one `error:` line with no traceback."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.weights import save_hf_dir
from test_api import DOC, QUESTIONS, tiny_tokenizer
from tiny import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parent.parent


def run_tool(tool: str, *args, limit_file_bytes: int | None = None, env: dict | None = None, preexec=None,
             **kw) -> subprocess.CompletedProcess:
    """`python -m minillama TOOL ...` in a fresh process; with `limit_file_bytes`, every write past that
    size fails as on a full disk (EFBIG, from RLIMIT_FSIZE); `preexec` runs in the child first."""
    def before() -> None:
        if limit_file_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))
        if preexec is not None:
            preexec()

    if "stdout" not in kw and "stderr" not in kw:
        kw["capture_output"] = True
    return subprocess.run([sys.executable, "-m", "minillama", tool, *map(str, args)], text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=600,
                          preexec_fn=before, **kw)


def one_line_error(p: subprocess.CompletedProcess | tuple[int, str], code: int = 2) -> str:
    rc, err = (p.returncode, p.stderr) if isinstance(p, subprocess.CompletedProcess) else p
    assert rc == code, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), err
    return lines[-1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    tok = tiny_tokenizer()
    config = tiny_config(vocab=tok.vocab_size, max_pos=512, tied=True)
    return save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, tmp_path_factory.mktemp("c") / "tiny")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("in")
    (d / "doc.txt").write_text(DOC + "\n")
    (d / "q.txt").write_text("\n".join(QUESTIONS) + "\n")
    return {"doc": d / "doc.txt", "questions": d / "q.txt", "dir": d}
