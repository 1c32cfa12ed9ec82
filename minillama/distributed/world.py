"""The process world of a distributed run: data-parallel groups of tensor-parallel ranks, on torch.distributed.

Started by `torchrun` (or `minillama generate --procs N`, distributed/launch.py), which sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT. The world is a (dp, tp) `DeviceMesh`: `torchrun --nproc-per-node 4
... --tp 2` makes two data-parallel groups of two tensor-parallel ranks (ranks 0-1 and 2-3). Collectives run
on gloo for a CPU and NCCL for a GPU; the answers travel to rank 0 over a gloo group in every case.
Every group has a timeout, so a rank that stops answering ends the run rather than hanging it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import check_degrees


@dataclass
class World:
    rank: int  # global
    size: int
    dp: int  # data-parallel groups
    tp: int  # tensor-parallel ranks per group
    dp_rank: int  # which group this rank is in
    tp_rank: int  # its place in the group
    tp_group: dist.ProcessGroup | None  # None when tp == 1
    answers: dist.ProcessGroup  # gloo, all ranks: answers and errors travel to rank 0

    @property
    def writes(self) -> bool:
        """Rank 0 writes every answer; the first rank of each other group sends its group's answers there."""
        return self.rank == 0

    @property
    def sends(self) -> bool:
        return self.tp_rank == 0 and self.rank != 0


def init(tp: int, device: torch.device, timeout_s: float) -> World:
    """Join the process group torchrun described in the environment and build the (dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    size = int(os.environ.get("WORLD_SIZE", "1"))
    check_degrees(None, tp, None, size)
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (size // tp, tp), mesh_dim_names=("dp", "tp"))
    answers = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return World(rank=rank, size=size, dp=size // tp, tp=tp, dp_rank=mesh["dp"].get_local_rank(),
                 tp_rank=mesh["tp"].get_local_rank(), tp_group=mesh["tp"].get_group() if tp > 1 else None,
                 answers=answers)


def single() -> World:
    """The world of a run on one process."""
    return World(0, 1, 1, 1, 0, 0, None, None)  # type: ignore[arg-type]


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
