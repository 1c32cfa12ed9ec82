"""How minillama's CPU threads wait: importing the package before torch makes OpenMP's waiting threads sleep
(`OMP_WAIT_POLICY=PASSIVE`, minillama/__init__.py), and a policy the user named is kept.

Each case runs in a fresh interpreter, since OpenMP reads the policy once, when torch loads it. GNU OpenMP
(torch's CPU wheels) prints what it read with `OMP_DISPLAY_ENV=VERBOSE`: a passive policy is a spin count of
0, its own default 300,000 spins (which is why an unset policy is not enough: a spinning thread holds the
core its descheduled partner needs).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _openmp(code: str, **env: str) -> tuple[str, str]:
    """(OMP_WAIT_POLICY as the program saw it, GNU OpenMP's spin count as it read it) for `code`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    clean.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         env=clean, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    spins = re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr)
    assert spins, f"torch's OpenMP did not report its settings:\n{run.stderr[-2000:]}"
    return run.stdout.split()[-1], spins.group(1)


def test_minillama_first_makes_waiting_threads_sleep():
    assert _openmp("import minillama.api") == ("PASSIVE", "0")


def test_a_policy_the_user_named_is_kept():
    policy, spins = _openmp("import minillama.api", OMP_WAIT_POLICY="ACTIVE")
    assert policy == "ACTIVE" and int(spins) > 0


def test_torch_first_keeps_the_runtimes_default():
    """What the package cannot change, and the control the first test is measured against."""
    policy, spins = _openmp("import torch; import minillama.api")
    assert policy == "PASSIVE" and int(spins) > 0  # set too late: OpenMP read the environment already
