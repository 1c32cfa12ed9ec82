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

import json
import os
import sys
import threading
from dataclasses import asdict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..api import Reply
from .world import World

ANSWER, DONE, ERROR = 1, 2, 3
HEADER, PAYLOAD, HEARD = 1, 2, 3  # message tags


def share_documents(costs: Sequence[int], groups: int) -> list[list[int]]:
    """Document indices per group: the costliest first, each to the group with the least so far (ties to the
    lower group), each group's share in input order."""
    load = [0] * groups
    shares: list[list[int]] = [[] for _ in range(groups)]
    for d in sorted(range(len(costs)), key=lambda d: (-costs[d], d)):
        g = min(range(groups), key=lambda g: (load[g], g))
        shares[g].append(d)
        load[g] += costs[d]
    return [sorted(s) for s in shares]


class Channel:
    """One rank's end of the answers' way to rank 0; `on_reply` is `api.ask_many`'s callback.

    jobs: every document's (doc, questions); share: the documents of this rank's group. On rank 0, `write`
    (called under a lock, from this thread or the receiving one) gets every answer with its index over all
    questions; on a group's first rank, answers go to rank 0; other ranks only compute."""

    def __init__(self, world: World, jobs: Sequence[tuple[str, Sequence[str]]], share: Sequence[int],
                 write: Callable[[int, Reply], None] | None):
        self.world, self.share, self.write = world, list(share), write
        starts, n = [], 0
        for _, questions in jobs:
            starts.append(n)
            n += len(questions)
        self.first_question = [starts[d] for d in self.share]  # each of this share's documents, in the whole
        self.lock = threading.Lock()
        self.remote_stats: list[dict[str, Any]] = []
        self._receiver: threading.Thread | None = None
        if world.writes and world.dp > 1:
            self._receiver = threading.Thread(target=self._receive, daemon=True, name="minillama-answers")
            self._receiver.start()

    # --- every rank ---------------------------------------------------------------------------------

    def on_reply(self, i: int, reply: Reply) -> None:
        """i counts the questions of this share; the reply's document index is the share's."""
        d = reply.doc_index
        reply.doc_index = self.share[d]
        g = self.first_question[d] + reply.question_index
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

    def error(self, message: str, code: int) -> None:
        """Tell rank 0 that this rank failed (a rank that is not rank 0), and wait until it has said so: the
        launcher ends every rank as soon as one exits."""
        try:
            self._send(ERROR, code, f"rank {self.world.rank}: {message}".encode())
            dist.recv(torch.empty(1), src=0, group=self.world.answers, tag=HEARD)
        except Exception:  # rank 0 may be gone too; the launcher reports the exit status
            pass

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
        dist.send(header, dst=0, group=self.world.answers, tag=HEADER)
        if payload:
            dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=0, group=self.world.answers,
                      tag=PAYLOAD)

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
                    with self.lock:
                        self.write(index, Reply(**json.loads(text)))
                elif kind == DONE:
                    self.remote_stats.append(json.loads(text))
                    waiting -= 1
                else:
                    self.fail(text, index, heard=src)
        except RuntimeError as e:  # a peer closed its end or the group's timeout passed
            first = (str(e).splitlines() or ["no reason given"])[0]
            self.fail(f"lost contact with another rank ({first}); the answers written so far are complete", 1)
