"""`minillama generate ARGS` with a fault planted in rank 1 only, as a device or a machine of its own would meet
it (tests/test_distributed.py): `python tests/_dist_rank_fault.py KIND generate ...` under torchrun, or with
--procs (whose ranks import this file again, so they are planted too). KIND, in rank 1's third forward pass:
"bug" (a RuntimeError), "refusal" (a one-line error), "oom" (torch's OutOfMemoryError) or "hang" (rank 1 stops
answering); or while rank 1 loads the model, before the ranks agree on their input: "slow-load" (it takes
SLOW_LOAD_S longer) or "oom-load" (a MemoryError). $FAULT_RANK plants the load's faults in another rank."""

import os
import sys
import time

import minillama  # noqa: F401
import minillama.cli as cli
import torch
from minillama.errors import OneLineError
from minillama.model import Llama

KIND = sys.argv[1]
SLOW_LOAD_S = 8
calls = 0
forward, load = Llama.forward, cli.load_checkpoint


def planted(self, *args, **kwargs):
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 3:
        if KIND == "hang":
            time.sleep(3600)
        kind = {"refusal": OneLineError, "oom": torch.OutOfMemoryError}.get(KIND, RuntimeError)
        raise kind("planted: rank 1's device is out of memory")
    return forward(self, *args, **kwargs)


def planted_load(*args, **kwargs):
    here = os.environ.get("RANK") == os.environ.get("FAULT_RANK", "1")
    if here and KIND == "slow-load":
        time.sleep(SLOW_LOAD_S)
    if here and KIND == "oom-load":
        raise MemoryError("planted: rank 1 ran out of host memory while loading")
    return load(*args, **kwargs)


Llama.forward, cli.load_checkpoint = planted, planted_load

if __name__ == "__main__":
    from minillama.__main__ import main

    sys.exit(main(sys.argv[2:]))
