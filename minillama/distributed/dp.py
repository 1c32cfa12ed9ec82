"""Data parallelism: the documents split over the data-parallel groups, every answer written by rank 0.

Each group runs parallel prompting on its share of the documents, balanced by token count. The first rank of
each group sends each answer to rank 0 as soon as it is finished (point-to-point over the world's gloo
group: a header [kind, question index, bytes] and a JSON payload); rank 0 writes every answer in input order,
streamed, exactly as one process would (cli.AnswerWriter). Sampled answers keep the random stream of their
question's index in the whole input, so the bytes out do not depend on the number of groups.

A rank that fails sends one line naming itself and the cause; rank 0 writes it, keeps what it has written and
exits non-zero. A rank that dies without a word is seen by the launcher (torchrun, or --procs), which ends
the others; the process group's timeout bounds any wait in between.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist

from ..api import Reply
from ..errors import (OneLineError, RankRefused, SaidElsewhere, first_line, memory_cause, one_line, out_of_memory,
                      report)
from .world import World

ANSWER, DONE, ERROR = 1, 2, 3
HEADER, PAYLOAD, HEARD = 1, 2, 3  # message tags
PEER_GRACE_S = 5.0  # how long a rank leaves another (or the launcher) to say an error first


Piece = tuple[int, int, int]  # (document, first question, past its last question): a run of one document's questions


def share_questions(doc_costs: Sequence[int], question_costs: Sequence[Sequence[int]], groups: int,
                    whole_documents: bool = False) -> list[list[Piece]]:
    """Each group's pieces: the input's questions, in input order, cut into at most `groups` runs so that the
    costliest run costs least. A run pays for each of its questions and, once, for each document it touches
    (a document split between two groups is prefilled by both). `whole_documents` cuts only between
    documents (seqbatch: an answer there sees the earlier questions of its document). A group past the last
    run gets nothing to do."""
    if whole_documents:
        items = [(d, 0, len(qs), sum(qs)) for d, qs in enumerate(question_costs)]
    else:
        items = [(d, k, k + 1, c) for d, qs in enumerate(question_costs) for k, c in enumerate(qs)]

    def cut(most: int) -> list[list[Piece]] | None:
        """The fewest runs none of which costs more than `most`, filled greedily; None if more than `groups`."""
        runs: list[list[Piece]] = []
        load = most + 1
        for d, lo, hi, c in items:
            if runs and runs[-1][-1][0] == d and load + c <= most:
                runs[-1][-1] = (d, runs[-1][-1][1], hi)
                load += c
            elif runs and load + doc_costs[d] + c <= most:
                runs[-1].append((d, lo, hi))
                load += doc_costs[d] + c
            else:
                runs.append([(d, lo, hi)])
                load = doc_costs[d] + c
        return runs if len(runs) <= groups else None

    lo = max((doc_costs[d] + c for d, _, _, c in items), default=0)
    hi = sum(doc_costs) + sum(c for *_, c in items)
    while lo < hi:  # the least cost of the costliest run
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cut(mid) is not None else (mid + 1, hi)
    runs = cut(hi) or []
    return runs + [[] for _ in range(groups - len(runs))]


class Channel:
    """One rank's end of the answers' way to rank 0; `on_reply` is `api.ask_many`'s callback.

    jobs: every document's (doc, questions); share: the pieces of this rank's group (`share_questions`), which
    it answers as documents of their own. On rank 0, `write` (called under a lock, from this thread or the
    receiving one) gets every answer with its index over all questions; on a group's first rank, answers go to
    rank 0; other ranks only compute."""

    def __init__(self, world: World, jobs: Sequence[tuple[str, Sequence[str]]], share: Sequence[Piece],
                 write: Callable[[int, Reply], None] | None):
        self.world, self.share, self.write = world, list(share), write
        starts, n = [], 0
        for _, questions in jobs:
            starts.append(n)
            n += len(questions)
        self.first_question = [starts[d] + lo for d, lo, _ in self.share]  # each piece's, in the whole input
        self.lock = threading.Lock()
        self.remote_stats: list[dict[str, Any]] = []
        self._receiver: threading.Thread | None = None
        if world.writes and world.dp > 1:
            self._receiver = threading.Thread(target=self._receive, daemon=True, name="minillama-answers")
            self._receiver.start()

    # --- every rank ---------------------------------------------------------------------------------

    def on_reply(self, i: int, reply: Reply) -> None:
        """i counts the questions of this share; the reply's document index is the piece's, its question
        index the piece's own."""
        d, lo, _ = self.share[reply.doc_index]
        g = self.first_question[reply.doc_index] + reply.question_index
        reply.doc_index, reply.question_index = d, lo + reply.question_index
        if self.world.writes:
            with self.lock:
                self.write(g, reply)
        elif self.world.sends:
            fields = asdict(reply)
            fields.pop("logits", None)
            self._send(ANSWER, g, json.dumps(fields).encode())

    def done(self, stats: dict[str, Any]) -> None:
        """This rank's work is finished; rank 0 waits here for every group."""
        if self.world.sends:
            self._send(DONE, 0, json.dumps(stats).encode())
        if self._receiver is not None:
            self._receiver.join()

    def error(self, message: str, code: int) -> bool:
        """Tell rank 0 that this rank failed (a rank that is not rank 0), and wait until it has said so: the
        launcher ends every rank as soon as one exits. False where rank 0 cannot hear it: one data-parallel
        group runs no receiving thread, and rank 0's only thread may be waiting on this rank in a collective."""
        if self.world.dp == 1:
            return False
        try:
            self._send(ERROR, code, f"rank {self.world.rank}: {message}".encode())
            dist.recv(torch.empty(1), src=0, group=self.world.answers, tag=HEARD)
        except Exception:  # rank 0 may be gone too; the launcher reports the exit status
            pass
        return True

    def fail(self, message: str, code: int, heard: int | None = None) -> None:
        """Rank 0: write one line, keep what is written, end this process now (its peers may be blocked).
        heard: the failed rank that waits for this line to be written."""
        with self.lock:
            sys.stdout.flush()
            print(f"error: {message}", file=sys.stderr, flush=True)
            if heard is not None:
                dist.send(torch.zeros(1), dst=heard, group=self.world.answers, tag=HEARD)
            os._exit(code)

    # --- the wire -----------------------------------------------------------------------------------

    def _send(self, kind: int, index: int, payload: bytes) -> None:
        header = torch.tensor([kind, index, len(payload)], dtype=torch.int64)
        try:
            dist.send(header, dst=0, group=self.world.answers, tag=HEADER)
            if payload:
                dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=self.world.answers,
                          tag=PAYLOAD)
        except RuntimeError as e:  # rank 0 has ended (a closed pipe, a full disk): it says why, this rank stops
            if "timed out" in str(e).lower():  # rank 0 is there and took nothing: it can say nothing, so this rank does
                print(f"error: rank {self.world.rank}: rank 0 took no answer within --dist-timeout: it waits to "
                      "write, as when its standard output is not read (a pager, a slow pipe); read it, or raise "
                      "--dist-timeout", file=sys.stderr, flush=True)
            raise SaidElsewhere(f"rank 0 has stopped ({first_line(e)})") from None

    def _receive(self) -> None:
        """Rank 0's receiving thread: answers from every other group until each has said it is done."""
        waiting = self.world.dp - 1
        try:
            while waiting:
                header = torch.empty(3, dtype=torch.int64)
                src = dist.recv(header, src=None, group=self.world.answers, tag=HEADER)
                kind, index, n = header.tolist()
                data = torch.empty(n, dtype=torch.uint8)
                if n:
                    dist.recv(data, src=src, group=self.world.answers, tag=PAYLOAD)
                text = bytes(data.numpy()).decode()
                if kind == ANSWER:
                    self._write(index, Reply(**json.loads(text)))
                elif kind == DONE:
                    self.remote_stats.append(json.loads(text))
                    waiting -= 1
                else:
                    self.fail(text, index, heard=src)
        except RuntimeError as e:  # a peer closed its end or the group's timeout passed
            self.fail(f"lost contact with another rank ({first_line(e)}); the answers written so far are complete", 2)

    def _write(self, index: int, reply: Reply) -> None:
        """Write an answer from this thread; when writing fails (the reader of stdout went away, a full disk)
        the one error runner says so and this thread ends the process (`end`)."""
        try:
            with self.lock:
                self.write(index, reply)
        except BaseException as e:
            end(e)


def end(error: BaseException) -> NoReturn:
    """End this rank now, with the line and status of the one error runner (`errors.report`; a bug's
    traceback, status 1). A rank of a running world cannot return from its main function: its peers may be
    blocked on it, and the process group's threads would abort the interpreter's exit."""
    code = report(error)
    if code is None:
        traceback.print_exception(error)
        code = 1
    sys.stderr.flush()
    os._exit(code)


def lost_contact(world: World, message: str) -> NoReturn:
    """A collective failed: another rank has ended (it, or its launcher, says why, and the launcher ends this
    rank) or stopped answering. Still here PEER_GRACE_S later, rank 0 says `message` and ends (status 2); any
    other rank waits as long again, for rank 0 to say it, and then says it naming itself (rank 0 may be the
    one that stopped)."""
    time.sleep(PEER_GRACE_S if world.rank == 0 else 2 * PEER_GRACE_S)
    end(RankRefused(message if world.rank == 0 else f"rank {world.rank}: {message}"))


def input_key(jobs: Sequence[tuple[str, Sequence[str]]]) -> tuple[int, int, str]:
    """What the ranks compare of the input each read: documents, questions and a digest of all of it."""
    digest = hashlib.sha256(json.dumps(jobs, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
    return len(jobs), sum(len(q) for _, q in jobs), digest[:16]


def agree(world: World, prepare: Callable[[], Any], same: Callable[[Any], Any] | None = None) -> Any:
    """Run `prepare` (read the input, load the model, check the prompts' length) on every rank, then learn in
    one exchange whether any rank refused: before any work is shared, so that a refusal stops every rank at
    once rather than at the process group's timeout. Rank 0 says every refusal (one line; a message that
    every rank gave, once, as one process would); a refusing rank on another machine says its own there;
    every other rank stops quietly. `same(result)`: what must be equal on every rank (`input_key`: the input
    each read, which differs where they read a changing file), refused where it is not. Out of memory is a
    refusal (the machine's); a rank that never comes to the exchange (slower than --dist-timeout to load, or
    dead) is `lost_contact`. Returns what `prepare` returned."""
    if world.size == 1:
        return prepare()
    try:
        done, mine = prepare(), None
    except OneLineError as e:
        done, mine = None, one_line(str(e)) or type(e).__name__
    except Exception as e:  # this rank's memory is the machine's refusal, as a bad input is
        if not out_of_memory(e):
            raise
        done, mine = None, memory_cause(e)
    machine = os.environ.get("GROUP_RANK", "0")  # torchrun's node rank; --procs runs on one machine
    said: list[Any] = [None] * world.size
    key = None if mine is not None or same is None else same(done)
    try:
        dist.all_gather_object(said, (machine, mine, key), group=world.answers)
    except RuntimeError as e:  # a rank died loading, or took longer than --dist-timeout to get here
        lost_contact(world, f"lost contact with another rank while the ranks started ({first_line(e)}); a rank "
                            "that takes longer than --dist-timeout to read its input and load the model needs a "
                            "larger one")
    refusals = {}  # message -> the ranks that gave it
    for rank, (_, message, _) in enumerate(said):
        if message is not None:
            refusals.setdefault(message, []).append(rank)
    keys = {k for _, m, k in said if m is None}
    if not refusals and len(keys) > 1:
        read = "; ".join(f"rank {r}: {k[0]} documents, {k[1]} questions" if isinstance(k, tuple) else f"rank {r}: {k}"
                         for r, (_, _, k) in enumerate(said))
        refusals[f"the ranks read different input ({read}): every rank reads the input itself, so give files "
                 "that do not change while the ranks start"] = list(range(world.size))
    if not refusals:
        return done
    dist.destroy_process_group()  # every rank is here: leave together, before saying why
    if world.rank == 0:
        if len(refusals) == 1 and len(next(iter(refusals.values()))) == world.size:
            raise RankRefused(next(iter(refusals)))
        raise RankRefused("; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {m}"
                                    for m, r in refusals.items()))
    if mine is not None and machine != said[0][0]:
        raise RankRefused(f"rank {world.rank}: {mine}")
    raise SaidElsewhere("another rank refused its input")
