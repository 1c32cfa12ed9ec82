"""How torch's OpenMP threads wait at the end of a parallel region: chosen here, before torch loads.

A forward pass on a CPU is thousands of small parallel regions (3,343 in a 128-row decode step of the
default model, about 7,600 in a 512-token prefill pass), each ending in a barrier. GNU OpenMP's threads
spin 300,000 times there before they sleep. On an idle machine spinning is the quickest way to wait; with
another process wanting a core, a spinning thread holds the core that its own descheduled partner needs
to reach the barrier, and every region waits on the scheduler. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`)
gives the core back, but on an idle machine each region then pays for a wake-up. So, when minillama is
imported and the environment names neither a policy nor a spin count:

    threads running elsewhere now + the cores torch will use > the machine's cores   ->  PASSIVE
    otherwise                                                                         ->  GOMP_SPINCOUNT=1000

(docs/bench/README.md#a-cpu-shared-with-other-work has the measurements). How threads wait never changes
what they compute: the bits are the same either way. OpenMP reads these settings once, when torch loads it,
so a program that imported torch before minillama keeps the runtime's own default, and its environment as
it was (its child processes inherit no setting chosen for another process).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

SHORT_SPIN = "1000"  # spins before sleeping on an idle machine: a few microseconds, not GNU OpenMP's 300,000
READINGS, INTERVAL_S = 10, 0.002  # how often, and how far apart, the machine's runnable threads are read


def _running_now() -> int:
    """Threads running or ready to run on the machine at this instant, this one included (Linux's
    /proc/loadavg, its fourth field: runnable / all)."""
    with open("/proc/loadavg", encoding="ascii") as f:
        return int(f.read().split()[3].split("/")[0])


def running_elsewhere(read: Callable[[], int] = _running_now, readings: int = READINGS,
                      interval_s: float = INTERVAL_S) -> int | None:
    """Threads that keep wanting a core besides this one: the fewest of `readings` readings ~2 ms apart,
    this one left out; None where they cannot be read. One reading is not enough: the processes that start
    beside this one (a shell pipeline's other commands, a parent that just forked) are runnable for a
    moment, and on 2 cores one such moment would choose passive waiting, which costs an idle machine
    1.3-1.5x; a busy process is runnable at every reading. A reading of this thread alone ends it: fewer
    cannot be read, so an idle machine costs one reading, not ~20 ms of start-up."""
    try:
        fewest = read()
        for _ in range(readings - 1):
            if fewest <= 1:
                break
            time.sleep(interval_s)
            fewest = min(fewest, read())
        return max(0, fewest - 1)
    except (OSError, ValueError, IndexError):
        return None


def wait_settings(elsewhere: int | None, ours: int, cpus: int) -> dict[str, str]:
    """The OpenMP settings for a process whose torch will use `ours` of the machine's `cpus` cores while
    `elsewhere` other threads want one (None: unknown, taken as none)."""
    if elsewhere is not None and elsewhere + ours > cpus:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": SHORT_SPIN}


def choose_wait_policy(environ: dict[str, str] | None = None) -> None:
    """Put `wait_settings` for this process into the environment, unless it names a policy or a spin count,
    or torch is loaded already (OpenMP has read its settings: one written now would change nothing here, only
    the processes the program starts, which inherit the environment)."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ or "torch" in sys.modules:
        return
    cpus = os.cpu_count() or 1
    ours = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus  # torch's default threads
    environ.update(wait_settings(running_elsewhere(), ours, cpus))
