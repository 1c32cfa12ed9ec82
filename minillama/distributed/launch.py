"""`--procs N`: start N ranks on this machine through torch's own process starter, as torchrun would.

The command line was read and checked once, here; each rank gets the parsed options and the documents (so
standard input works too), the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and its share of the CPUs this process may use. The ranks join a
torch.distributed process group as under torchrun. When one fails, `torch.multiprocessing` ends the others
and this process says which rank and why, in one line. `check_procs` bounds N by what the machine has.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import Any, Sequence

from ..waves import available_memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (taskset, a container's cpuset), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


RANKS_PER_CPU = 2  # ranks past the cores take turns on them; twice lets a small machine run a bigger layout
RANK_MEMORY = 256 << 20  # a rank before its model: Python, torch and a process group (about 220 MiB resident)


def check_procs(args: argparse.Namespace) -> None:
    """--procs N within what this machine can run, or BadInput. Each rank is a process of its own that
    computes on at least one thread and holds at least RANK_MEMORY before any model: at most RANKS_PER_CPU
    ranks per CPU this process may use (past the cores they only take turns, and no answer changes: the bytes
    do not depend on the number of ranks; twice the cores still lets a small machine check the layout of a
    bigger one, such as --procs 3 --tp 3), and no more than the available memory holds. With --device cuda
    every rank takes a GPU of its own."""
    from ..errors import BadInput

    if args.device.startswith("cuda"):
        import torch

        gpus = torch.cuda.device_count()
        if args.procs > gpus:
            raise BadInput(f"--procs {args.procs}: every rank takes a GPU of its own, and {gpus} are visible")
        return
    cpus, memory = usable_cpus(), available_memory()
    if args.procs > RANKS_PER_CPU * cpus:
        raise BadInput(f"--procs {args.procs}: more than {RANKS_PER_CPU} ranks for each of the {cpus} CPUs this "
                       f"process may use (at most --procs {RANKS_PER_CPU * cpus})")
    if memory is not None and args.procs * RANK_MEMORY > memory:
        raise BadInput(f"--procs {args.procs}: each rank needs at least {RANK_MEMORY >> 20} MiB before its model, "
                       f"and {memory >> 20} MiB are available (at most --procs {memory // RANK_MEMORY})")


def _thread_count(given: str | None, default: int) -> str:
    """OMP_NUM_THREADS for each rank: the one given where it is a count (>= 1), else `default` (the machine's
    cores shared out); "abc", "0" or "²" (a digit to str.isdigit, no number to int), which OpenMP passes over with
    a warning, once ended every rank."""
    count = (given or "").strip()
    return count if count.isascii() and count.isdigit() and int(count) > 0 else str(default)


def run(args: argparse.Namespace, jobs: Sequence[Any], entry) -> int:
    """Start args.procs ranks of `entry(args, jobs)` (cli.answer); returns the exit status."""
    import torch.multiprocessing as mp

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # this function says what ended
    threads = max(1, usable_cpus() // args.procs)
    env = {"WORLD_SIZE": str(args.procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": _thread_count(os.environ.get("OMP_NUM_THREADS"), threads)}
    ctx, early = None, []

    def signalled(signum: int, frame: Any) -> None:
        if ctx is None:  # the ranks are starting: they are ended once all have started, none orphaned
            early.append(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            raise Terminated

    # SIGTERM (`timeout`, a job scheduler) ends the ranks as Ctrl-C does, rather than orphan them. Both are taken
    # from before the first rank starts: taken after, one sent while they started ended the launcher alone
    # (SIGTERM: exit -15; SIGINT: a KeyboardInterrupt before any rank was known to be ended).
    # A SIGINT that was ignored (a job started with `&` by a script) stays ignored.
    previous, ignored = {}, signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    for signum in [signal.SIGTERM] + ([] if ignored else [signal.SIGINT]):
        try:
            previous[signum] = signal.signal(signum, signalled)
        except ValueError:  # not the main thread: signals are the main thread's to take
            break
    try:
        ctx = mp.start_processes(_rank, args=(entry, args, jobs, env), nprocs=args.procs, join=False,
                                 start_method="spawn")
        if early:
            raise KeyboardInterrupt if early[0] == signal.SIGINT else Terminated
        while not ctx.join():
            pass
    except mp.ProcessExitedException as e:
        if e.signal_name:
            print(f"error: rank {e.error_index} was ended by {e.signal_name}; the answers written before it "
                  "are complete", file=sys.stderr)
            return 1
        return e.exit_code or 1  # the rank wrote its own line
    except mp.ProcessRaisedException as e:  # a bug: the rank's traceback, then one line
        print(f"error: rank {e.error_index} failed:\n{e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Terminated) as e:
        said = isinstance(e, KeyboardInterrupt) and not early and _rank_0_said_it(ctx)
        for p in ctx.processes if ctx is not None else []:
            if p.is_alive():
                p.terminate()
        if not said:
            print("interrupted" if isinstance(e, KeyboardInterrupt) else "terminated", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 128 + signal.SIGTERM
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


class Terminated(Exception):
    """The launcher was sent SIGTERM."""


INTERRUPT_GRACE_S = 5.0  # how long a Ctrl-C leaves rank 0 to say what it wrote before its launcher ends it


def _rank_0_said_it(ctx) -> bool:
    """After Ctrl-C at a terminal, which sends it to every rank too: whether rank 0 ended by itself within
    INTERRUPT_GRACE_S with Ctrl-C's status, having said "interrupted: K of N answers written" (or "interrupted"
    before its first answer), as one process does. Sent to this process alone (`kill -INT`), no rank heard it:
    they are ended after the grace. A second Ctrl-C ends them at once."""
    rank_0 = ctx.processes[0]
    try:
        rank_0.join(INTERRUPT_GRACE_S)
    except KeyboardInterrupt:
        return False
    return rank_0.exitcode == 130



def _rank(local_rank: int, entry, args: argparse.Namespace, jobs: Sequence[Any], env: dict[str, str]) -> None:
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = entry(args, jobs)
    sys.stdout.flush()
    if code:  # a rank that stops early (Ctrl-C) is still in its process group, whose threads abort Python's exit
        sys.stderr.flush()
        os._exit(code)
