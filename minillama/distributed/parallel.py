"""What `minillama generate` calls to run as one process or as one rank of many.

    here = join(args)                 # this process's place in the world (one process: a world of one)
    shard = sharding(args, here)      # a tensor-parallel rank's: the loader reads only its parts
    jobs, model = here.agree(prepare) # every rank's input read and checked, and any refusal heard by all
    place(model, args, here)          # the product units; the model on args.device
    shares(jobs, here, tokenizer)     # the questions each data-parallel group answers
    channel = here.channel(...)       # each finished answer: written (rank 0) or sent there
    totals = here.finish(channel, stats)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import OneLineError, RankRefused, SaidElsewhere, first_line, memory_cause, out_of_memory
from ..generate import Stats
from ..model import Llama
from . import check_degrees, launched
from . import tp as tensor_parallel
from .dp import PEER_GRACE_S, Channel, Piece, agree, end, lost_contact, share_questions
from .world import World, finish, init, single


@dataclass
class Here:
    world: World
    units: int = 1
    kv_heads: int = 1
    _channel: Channel | None = field(default=None, repr=False)

    def agree(self, prepare, same=None):
        """`prepare()` on every rank, and every rank stops at once when one refuses, or where `same` of what
        it returned differs between the ranks (`dp.agree`)."""
        return agree(self.world, prepare, same)

    def channel(self, jobs: Sequence[tuple[str, Sequence[str]]], share: Sequence[Piece], write) -> Channel:
        self._channel = Channel(self.world, jobs, share, write)
        return self._channel

    def failed(self, error: BaseException) -> None:
        """This rank hit an error while answering. Alone: nothing to do here (the caller raises it). In a
        distributed run another rank's error goes to rank 0, which says it; then this rank ends at once with
        the one error runner's status (`dp.end`), its peers and the process group being past waiting for.
        Where rank 0 cannot hear it (one data-parallel group: an error this rank alone met, such as its own
        device's memory, while rank 0 waits on it in a collective), this rank says it and ends; its launcher
        (torchrun, --procs) then ends the others at once rather than at the group's timeout."""
        if self.world.size == 1 or self._channel is None:
            return
        if _lost_peer(error):  # another rank has ended or hangs (`dp.lost_contact`)
            lost_contact(self.world, f"lost contact with another rank in a collective ({first_line(error)}); "
                                     "the answers written so far are complete")
        if not self.world.writes and not self.world.sends:
            # A tensor-parallel peer of the rank that sends its group's answers: that rank meets the same error
            # (the group runs as one) and reports it after its last answer, which this rank's report could
            # overtake, rank 0 ending at the first. Said from here only where that rank did not say it first.
            time.sleep(PEER_GRACE_S)
        if not self.world.writes and not isinstance(error, SaidElsewhere):
            message = " ".join(str(error).split()) or type(error).__name__
            oom = out_of_memory(error)  # this rank's device: the machine's refusal, not a bug
            message = memory_cause(error) if oom else message
            code = 2 if isinstance(error, OneLineError) or oom else 1
            if code == 1:  # a bug: its traceback, then the line
                traceback.print_exception(error)
            if not self._channel.error(message, code):
                print(f"error: rank {self.world.rank}: {message}", file=sys.stderr, flush=True)
            sys.stderr.flush()
            os._exit(code)  # said, here or by rank 0: `end` would say an out-of-memory error a second time
        end(error)

    def finish(self, channel: Channel, stats: Stats) -> Stats:
        """Wait (rank 0) for every group; the totals over the groups."""
        channel.done(dataclasses.asdict(stats))
        totals = dataclasses.replace(stats)
        for other in channel.remote_stats:  # the groups ran side by side: the slowest one's times
            totals.prompt_tokens += other["prompt_tokens"]
            totals.generated_tokens += other["generated_tokens"]
            totals.forward_passes += other["forward_passes"]
            if other["prefill_s"] + other["decode_s"] > totals.generate_s:
                totals.prefill_s, totals.decode_s = other["prefill_s"], other["decode_s"]
        self.leave()
        return totals

    def leave(self) -> bool:
        """Leave the process group (a distributed run); True on the rank that reports (rank 0, or alone)."""
        if self.world.size > 1:
            finish()
        return self.world.rank == 0

    def summary(self) -> dict[str, Any]:
        if self.world.size == 1 and self.units == self.kv_heads:  # one process at the default units
            return {}
        return {"ranks": self.world.size, "dp": self.world.dp, "tp": self.world.tp, "units": self.units}


def _lost_peer(error: BaseException) -> bool:
    """An error torch.distributed raised from a collective (gloo raises a RuntimeError when a peer has gone)."""
    return isinstance(error, RuntimeError) and any(
        frame.filename.endswith("distributed_c10d.py") for frame in traceback.extract_tb(error.__traceback__))


def join(args: argparse.Namespace) -> Here:
    """One process, or this rank of the world torchrun (or --procs) started."""
    if not launched():
        return Here(single())
    if args.device.startswith("cuda") and ":" not in args.device:
        args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # one GPU per rank
    try:
        return Here(init(args.tp, torch.device(args.device), args.dist_timeout))
    except (RuntimeError, ValueError) as e:  # said by every rank that meets it: rank 0 may be the one not there
        raise RankRefused(f"rank {os.environ.get('RANK', '?')}: cannot join the process group: "
                          f"{first_line(e)}") from None


def load_device(args: argparse.Namespace, here: Here) -> str:
    """Where to load the checkpoint: a tensor-parallel rank loads on the host and `place` moves its shard."""
    return "cpu" if here.world.tp > 1 else args.device


def sharding(args: argparse.Namespace, here: Here) -> Callable[[Llama], dict[str, tuple[int, int, int]]] | None:
    """For `weights.load_model(..., shard=)` on a tensor-parallel rank (None otherwise): sets the units on the
    model skeleton, shards it over this rank's group and returns the parts of the split tensors it keeps,
    the only bytes the rank then reads."""
    if here.world.tp == 1:
        return None

    def shard(model: Llama) -> dict[str, tuple[int, int, int]]:
        model.units = units_of(model, args, here)
        tensor_parallel.shard_(model, here.world.tp_group)
        return tensor_parallel.slices(model, model.kernels.local)

    return shard


def units_of(model: Llama, args: argparse.Namespace, here: Here) -> int:
    """The product units (--units, default the KV heads: one process and every --tp dividing them give the
    same bits), checked against the degree by the one check (`check_degrees`)."""
    return check_degrees(model.config.num_key_value_heads, here.world.tp, args.units, here.world.size)


def place(model: Llama, args: argparse.Namespace, here: Here) -> None:
    """Set the product units (a model `sharding` did not shard yet: at --tp > 1 keep this rank's shard of it),
    and put a tensor-parallel rank's model on args.device."""
    here.units, here.kv_heads = units_of(model, args, here), model.config.num_key_value_heads
    if not model.kernels.sharded:
        model.units = here.units
        if here.world.tp > 1:
            tensor_parallel.shard_(model, here.world.tp_group)
    if here.world.tp > 1:
        model.to(args.device)
        tensor_parallel.tie_head_(model)


def shares(jobs: Sequence[tuple[str, Sequence[str]]], here: Here, tokenizer, max_new_tokens: int = 0,
           mode: str = "parallel") -> list[list[Piece]]:
    """The pieces (document, first question, past the last) of every data-parallel group, this rank's at its
    `dp_rank`: the questions cut into runs of balanced token count (`dp.share_questions`: each question and its
    answer's most tokens, each document once per group that holds some of its questions). seqbatch keeps
    documents whole."""
    if here.world.dp == 1:
        return [[(d, 0, len(questions)) for d, (_, questions) in enumerate(jobs)]]
    doc_costs = [len(tokenizer.encode(doc, parse_special=False)) for doc, _ in jobs]
    question_costs = [[len(tokenizer.encode(q, parse_special=False)) + max_new_tokens for q in questions]
                      for _, questions in jobs]
    return share_questions(doc_costs, question_costs, here.world.dp, whole_documents=mode == "seqbatch")


def piece_job(jobs: Sequence[tuple[str, Sequence[str]]], piece: Piece) -> tuple[str, list[str]]:
    """A piece of the input (document, first question, past the last) as a job of its own."""
    d, lo, hi = piece
    return jobs[d][0], list(jobs[d][1][lo:hi])
