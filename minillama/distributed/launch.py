"""`--procs N`: start N ranks on this machine through torch's own process starter, as torchrun would.

The command line was read and checked once, here; each rank gets the parsed options and the documents (so
standard input works too), the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, a free MASTER_PORT) and its share of the CPU's threads. The ranks join a
torch.distributed process group as under torchrun. When one fails, `torch.multiprocessing` ends the others
and this process says which rank and why, in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace, jobs: Sequence[Any], entry) -> int:
    """Start args.procs ranks of `entry(args, jobs)` (cli.answer); returns the exit status."""
    import torch.multiprocessing as mp

    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # this function says what ended
    threads = max(1, (os.cpu_count() or 1) // args.procs)
    env = {"WORLD_SIZE": str(args.procs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads))}
    ctx = mp.start_processes(_rank, args=(entry, args, jobs, env), nprocs=args.procs, join=False,
                             start_method="spawn")
    try:
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
    except KeyboardInterrupt:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _rank(local_rank: int, entry, args: argparse.Namespace, jobs: Sequence[Any], env: dict[str, str]) -> None:
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = entry(args, jobs)
    sys.stdout.flush()
    if code:
        sys.exit(code)
