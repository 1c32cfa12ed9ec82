"""A two-rank gloo world (run by torchrun, tests/test_distributed.py) in which rank 0's answer-writing thread
meets a closed pipe or a full disk when it writes the answer rank 1 sends: that thread must end the process
through the one error runner (141 quietly, or one line and status 2), with no traceback and no summary."""

import errno
import sys

import torch

from minillama.api import Reply
from minillama.distributed import dp
from minillama.distributed.world import init

world = init(1, torch.device("cpu"), 60)
fault = (OSError(errno.ENOSPC, "No space left on device") if sys.argv[1] == "full"
         else BrokenPipeError(errno.EPIPE, "Broken pipe"))


def write(index: int, reply: Reply) -> None:
    raise fault


# each rank answers the one question of its own document (the share's format: pieces, or documents before)
share = [(world.rank, 0, 1)] if hasattr(dp, "share_questions") else [world.rank]
channel = dp.Channel(world, [("doc 0", ["q"]), ("doc 1", ["q"])], share, write if world.rank == 0 else None)
if world.rank == 1:
    channel.on_reply(0, Reply("q", "a", [1], [0.0], "stop", [1]))
    try:
        channel.done({})
    except Exception:  # rank 0 has ended: its line is what counts
        pass
else:
    channel.done({})  # waits for the receiving thread, which meets the fault
    print("summary: every answer written", file=sys.stderr)
