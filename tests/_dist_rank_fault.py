"""`minillama generate ARGS` with a fault planted in rank 1's third forward pass only, as a device of its own
would meet it (tests/test_distributed.py): `python tests/_dist_rank_fault.py KIND generate ...` under torchrun,
or with --procs (whose ranks import this file again, so they are planted too). KIND: "bug" (a RuntimeError),
"refusal" (a one-line error), "oom" (torch's OutOfMemoryError) or "hang" (rank 1 stops answering)."""

import os
import sys
import time

import minillama  # noqa: F401
import torch
from minillama.errors import OneLineError
from minillama.model import Llama

KIND = sys.argv[1]
calls = 0
forward = Llama.forward


def planted(self, *args, **kwargs):
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 3:
        if KIND == "hang":
            time.sleep(3600)
        kind = {"refusal": OneLineError, "oom": torch.OutOfMemoryError}.get(KIND, RuntimeError)
        raise kind("planted: rank 1's device is out of memory")
    return forward(self, *args, **kwargs)


Llama.forward = planted

if __name__ == "__main__":
    from minillama.__main__ import main

    sys.exit(main(sys.argv[2:]))
