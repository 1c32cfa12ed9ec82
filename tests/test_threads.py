"""How minillama's CPU threads wait (threads.py): importing the package before torch makes OpenMP's waiting
threads sleep at once where other work wants the cores and spin briefly otherwise, and keeps what the user set.

Each case runs in a fresh interpreter, since OpenMP reads its settings once, when torch loads it. GNU OpenMP
(torch's CPU wheels) prints what it read with `OMP_DISPLAY_ENV=VERBOSE`: a passive policy is a spin count of
0, the package's short spin 1000, the runtime's own default 300,000.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from minillama.threads import SHORT_SPIN, choose_wait_policy, running_elsewhere, wait_settings

ROOT = Path(__file__).resolve().parent.parent


def _openmp(code: str, **env: str) -> tuple[dict[str, str | None], str]:
    """(OMP_WAIT_POLICY and GOMP_SPINCOUNT as the program saw them, the spin count GNU OpenMP read) for `code`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    clean.update(env, OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(ROOT))
    show = "; import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    run = subprocess.run([sys.executable, "-c", code + show], env=clean, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    spins = re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr)
    assert spins, f"torch's OpenMP did not report its settings:\n{run.stderr[-2000:]}"
    policy, count = (None if v == "None" else v for v in run.stdout.split()[-2:])
    return {"OMP_WAIT_POLICY": policy, "GOMP_SPINCOUNT": count}, spins.group(1)


def test_the_rule_sleeps_only_where_other_threads_want_the_cores():
    assert wait_settings(1, 2, 2) == {"OMP_WAIT_POLICY": "PASSIVE"}  # a busy process beside 2 threads on 2 cores
    assert wait_settings(0, 2, 2) == wait_settings(None, 2, 2) == {"GOMP_SPINCOUNT": SHORT_SPIN}
    assert wait_settings(1, 1, 2) == {"GOMP_SPINCOUNT": SHORT_SPIN}  # one thread of ours: a core is free
    assert wait_settings(63, 2, 64) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert running_elsewhere() is None or running_elsewhere() >= 0


def test_a_process_that_is_runnable_for_a_moment_is_not_work_beside_us():
    """The fewest runnable threads over several readings: a neighbour starting up (runnable for one reading)
    does not choose passive waiting, a busy one (runnable at every reading) does; this process is left out."""
    readings = iter([3, 2, 1, 1, 2])  # this process, plus a pipeline's commands starting for a moment
    assert running_elsewhere(lambda: next(readings), readings=5, interval_s=0) == 0
    busy = iter([2, 3, 2, 2, 2])  # this process and one that never stops
    assert running_elsewhere(lambda: next(busy), readings=5, interval_s=0) == 1
    assert running_elsewhere(lambda: int("not a number"), readings=3, interval_s=0) is None
    alone = iter([1])  # this thread alone at the first reading: nothing more to read (a second would raise)
    assert running_elsewhere(lambda: next(alone), readings=5, interval_s=0) == 0


def test_a_setting_in_the_environment_is_kept():
    for env in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "5"}):
        environ = dict(env)
        choose_wait_policy(environ)
        assert environ == env
    seen, spins = _openmp("import minillama.api", GOMP_SPINCOUNT="5000")
    assert seen == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5000"} and spins == "5000"


def test_openmp_reads_what_the_package_chose():
    """Whatever the machine's load, the choice reaches the runtime: passive is 0 spins, the short spin 1000."""
    seen, spins = _openmp("import minillama.api")
    assert spins == ("0" if seen["OMP_WAIT_POLICY"] == "PASSIVE" else SHORT_SPIN), (seen, spins)


def test_beside_a_busy_process_waiting_threads_sleep():
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen, spins = _openmp("import minillama.api")
    finally:
        busy.kill()
        busy.wait()
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) == os.cpu_count():  # torch takes every core: the busy one is in its way
        assert seen["OMP_WAIT_POLICY"] == "PASSIVE" and spins == "0"


def test_torch_first_keeps_the_runtimes_default():
    """What the package cannot change, and the control the tests above are measured against. Nor does it write
    a setting then: it would change nothing here, and the program's child processes would inherit it."""
    seen, spins = _openmp("import torch; import minillama.api")
    assert seen == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    assert spins == "300000"
