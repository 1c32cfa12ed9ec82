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


@dataclass
class Record:
    questions: list[QuestionRecord]
    manifest: dict[str, Any] = field(default_factory=dict)
    # Candidate logits computed on the reference's tokens (a backend run), not on the candidate's own answer.
    teacher_forced: bool = False
