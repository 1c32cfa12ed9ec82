"""The record types the oracle's parts share: what a run answered, per question, and the error for a record
that cannot be used. record.py makes, saves and loads records, a backend's `teacher_force` returns one and
diff.py compares them; this module imports none of those, so all of them can import it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import OneLineError


class RecordError(OneLineError):
    """A record or candidate file that cannot be read or does not fit the reference."""


def is_number(v: Any) -> bool:
    """A JSON number as a record or a server gives it: NaN and inf are theirs to give; an integer past a float's
    range (or a bool) is not a number."""
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= sys.float_info.max)


@dataclass
class QuestionRecord:
    prompt_ids: list[int] | None
    token_ids: list[int]
    logits: torch.Tensor | None = None  # (steps, vocab) float32
    logprobs: torch.Tensor | None = None  # (steps,) float32
    hidden: torch.Tensor | None = None  # (layers + 1, T, hidden)
    shared: int = 0  # leading prompt tokens run as its document's segment (shared with the other questions)
    doc: int = 0
    question: str | None = None
    finish_reason: str | None = None
    # A server's k most likely tokens at each step, best first (server.py): log-probs (steps, k), their ids
    # (-1 where a text names no single token) and texts.
    top_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_texts: list[list[str]] | None = None
    notes: list[str] = field(default_factory=list)  # what a backend could not check, said in the report

    def check(self, where: str) -> None:
        """Refuses, naming `where`, a question whose parts disagree: load runs it on every question of a file,
        `run_backend` on every question of a reference (one made in Python is never loaded)."""
        steps = len(self.token_ids)
        if self.logits is not None and (self.logits.dim() != 2 or self.logits.shape[0] != steps):
            raise RecordError(f"{where}: logits must be (steps, vocab) with one row per token id; got "
                              f"{tuple(self.logits.shape)} for {steps} token ids")
        if self.logprobs is not None and tuple(self.logprobs.shape) != (steps,):
            raise RecordError(f"{where}: logprobs must have one value per token id; got "
                              f"{tuple(self.logprobs.shape)} for {steps} token ids")
        if self.prompt_ids is not None and not len(self.prompt_ids):  # step 0's logits are the prompt's last row
            raise RecordError(f"{where}: prompt_ids is empty; a question's prompt holds at least one token")
        # Over the prompt and the answer but its last token, as export writes them: no fewer rows, none empty.
        tokens = None if self.prompt_ids is None else len(self.prompt_ids) + max(steps - 1, 0)
        h = self.hidden
        if h is not None and (h.dim() != 3 or 0 in h.shape or tokens not in (None, h.shape[1])):
            raise RecordError(f"{where}: hidden must be (layers + 1, tokens, hidden size) over "
                              f"{tokens or 'the prompt and the answer but its last'} tokens; got {tuple(h.shape)}")
        # A token id names a row of the vocabulary: a negative one would read from the row's end, a huge one fail.
        vocab = self.logits.shape[1] if self.logits is not None and self.logits.shape[1] else 2**31
        for key, ids in (("token_ids", self.token_ids), ("prompt_ids", self.prompt_ids or [])):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RecordError(f"{where}: {key} must be in 0 .. {vocab - 1}"
                                  f"{' (its logits rows)' if vocab < 2**31 else ''}; got {bad}")


@dataclass
class Record:
    questions: list[QuestionRecord]
    manifest: dict[str, Any] = field(default_factory=dict)
    # Candidate logits computed on the reference's tokens (a backend run), not on the candidate's own answer.
    teacher_forced: bool = False
