"""Moving a step's inputs onto the device and its chosen tokens back without making the host wait.

A copy from ordinary (pageable) host memory to a GPU waits for everything queued on the device before it
(torch synchronizes the stream), and reading a result back waits too. The host half of a pass (step.py) and
the decode loop (generate.py) would then plan each step only once the device is idle. Here host tensors go
through page-locked (pinned) memory with `non_blocking` copies, which the device performs in stream order
while the host goes on, and results come back into pinned memory behind an event that the host waits on
only when it reads them: the host lays out step t + 1 while the device computes step t. The values moved
are the same either way. On a CPU the device is the host: plain copies, nothing to overlap.
"""

from __future__ import annotations

import torch

# Device types whose copies go through pinned memory without waiting. Tests add "meta" or "cpu" to run this
# way on a CPU, with `pin`, `pinned_like` and `recorded_event` set to stand-ins (a CPU-only torch cannot pin
# memory or make CUDA events).
UNWAITED = {"cuda"}


def pin(t: torch.Tensor) -> torch.Tensor:
    """`t` in page-locked memory (torch's caching host allocator keeps the block until the copies that read
    it are done, so it may be dropped right after a copy is queued)."""
    return t.pin_memory()


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of t's shape and dtype, in page-locked memory."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def recorded_event(device: torch.device):
    """An event recorded now on `device`'s current stream: done once the work queued there so far is."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`: on a GPU queued behind the device's work, the host not waiting."""
    if t.device.type == "cpu" and device.type in UNWAITED:
        return pin(t).to(device, non_blocking=True)
    return t.to(device)


class Later:
    """A device tensor's values, read on the host when asked (`tolist`): on a GPU copied into pinned memory
    now, behind an event, so that the host waits only when it reads them; on a CPU read then."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.device.type in UNWAITED:
            self.host = pinned_like(t)
            self.host.copy_(t, non_blocking=True)
            self.event = recorded_event(t.device)  # on the copy's stream (t's device's)
        else:
            self.host = t

    def tolist(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.cpu().tolist()
