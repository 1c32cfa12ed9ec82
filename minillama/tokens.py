"""Each question's next token: chosen on the device for every row at once, recorded on the host.

`choose_tokens` issues the choice of a step (a log-softmax, an argmax and, for sampled rows, `sample_rows`
with each question's own random stream) and starts the one copy of the tokens, their log-probs and a NaN
flag per row to the host; it waits for nothing. `Chosen.record` reads that copy and records each question's
token. Between the two the host may lay out the next step, whose token ids are the choice itself, still on
the device (`Chosen.tokens`): generate._decode runs one step ahead of the host that way on a GPU.
`take_tokens` is the two in a row. Every operation is row-wise, so a row's bits do not depend on the others,
and sampling gives the same tokens in every mode too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .errors import BadInput
from .precision import why_not_finite
from .sampling import sample_rows, stream_key
from .tokenizer.base import decoded_after, whole_characters
from .transfer import Later, to_device


NEEDS_TOKENIZER = "stop strings need the tokenizer: SamplingParams.with_tokenizer(tokenizer)"


class StopStrings:
    """`SamplingParams.stop` for stop strings: True once the decoded answer holds one of them. Decoding needs
    the tokenizer, which `SamplingParams.with_tokenizer` binds (`api.ask_many` does)."""

    def __init__(self, strings: Sequence[str], tokenizer: Any = None, skip_special: bool = False):
        self.strings, self.tokenizer, self.skip_special = tuple(strings), tokenizer, skip_special

    def __call__(self, ids: list[int]) -> bool:
        """Whether the answer `ids` holds a stop string, asked after each token (so none was there before the
        last): its text as written (control tokens left out where the text leaves them out: a server's
        skip_special_tokens), read at its end only. The last 4 tokens' text (all a character's bytes, which
        may change the text before them) and the longest stop string's length before it, decoded after the
        tokens before (`decoded_after`: a stop string may span tokens, and a tail of ids decoded alone is not
        always a tail of the text), so a long answer does not decode all of itself at every token; a character
        not yet whole is not read (`whole_characters`: its U+FFFD once met a stop string "\ufffd")."""
        if self.tokenizer is None:
            raise ValueError(NEEDS_TOKENIZER)
        skip, start = self.skip_special, max(0, len(ids) - 4)
        tail = decoded_after(self.tokenizer, ids, start, skip)
        need, step = len(tail) + max(map(len, self.strings)), 8
        while len(tail) < need and start > 0:
            start, step = max(0, start - step), step * 2
            tail = decoded_after(self.tokenizer, ids, start, skip)
        tail = whole_characters(self.tokenizer, ids[-4:], tail)  # once, for every stop string
        return any(s in tail for s in self.strings)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StopStrings) and (other.strings, other.skip_special) == (self.strings, self.skip_special)

    def __repr__(self) -> str:
        return f"StopStrings({self.strings!r})"


@dataclass
class Answer:
    token_ids: list[int] = field(default_factory=list)  # generated ids, the stop token included
    logprobs: list[float] = field(default_factory=list)  # log-softmax of the raw logits at each token
    finish_reason: str = "length"  # "stop" (EOS, stop id or stop callback) or "length"
    logits: list[torch.Tensor] | None = None  # (vocab,) per step, with keep_logits


class Question:
    """One question in flight: its segment, the answer so far, and its random stream (public: minillama
    serve's engine schedules its own passes and picks tokens with these, exactly as generate does).
    `params` is a `generate.SamplingParams`."""

    def __init__(self, index: int, params: Any, eos: set[int],
                 on_answer: Callable[[int, Answer], None] | None = None, stream: int | None = None):
        self.index = index
        self.on_answer = on_answer
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
        self.answer = Answer(logits=[] if params.keep_logits else None)
        self.key = stream_key(params.seed, index if stream is None else stream)  # its random stream
        self.segment = -1
        self.next_pos = 0
        self.done = params.max_new_tokens == 0

    def record(self, tok: int, logprob: float, logits: torch.Tensor | None, max_positions: int,
               next_pos: int | None = None) -> None:
        """Record this step's token and decide whether the question is done; `next_pos`: the position after
        the token's step (default: the question's now; a decode step ahead of the host has moved it on)."""
        a = self.answer
        a.token_ids.append(tok)
        a.logprobs.append(logprob)
        if a.logits is not None:
            a.logits.append(logits)
        if tok in self.stop_ids or (self.params.stop is not None and self.params.stop(a.token_ids)):
            a.finish_reason, self.done = "stop", True
        elif self.ends_by_length(len(a.token_ids), max_positions, next_pos):
            a.finish_reason, self.done = "length", True
        if self.done and self.on_answer is not None:
            self.on_answer(self.index, a)

    def ends_by_length(self, tokens: int, max_positions: int, next_pos: int | None = None) -> bool:
        """Whether an answer of `tokens` tokens, the next at `next_pos` (default: the question's), is done for
        its length or the context (known before the token itself: a step ahead of the host leaves it out)."""
        return tokens >= self.params.max_new_tokens or (self.next_pos if next_pos is None else next_pos) >= max_positions


class Chosen:
    """One step's choice: the tokens on the device (`tokens`, (Q,): what the next step reads) and, on their
    way to the host, with their log-probs and NaN flags (`record` reads them, and only then waits)."""

    def __init__(self, tokens: torch.Tensor, host: Later, sampled: list[bool], logits: torch.Tensor | None,
                 next_pos: list[int], dtype: torch.dtype):
        self.tokens, self.host, self.sampled, self.logits = tokens, host, sampled, logits
        self.dtype = dtype  # the model's: the cause a NaN's message names
        self.next_pos = next_pos  # each question's position after this step, as it was when chosen

    def record(self, questions: list[Question], max_positions: int,
               agree: Callable[[list[int]], None] | None = None) -> list[Question]:
        """Record each question's token (row i is questions[i]); a question already done (finished by the step
        before, while this one ran ahead) is passed over, its row dropped. Returns the questions recorded."""
        toks, picked, nans = self.host.tolist()
        if agree is not None:  # a tensor-parallel rank: raises unless every rank chose these tokens (distributed/tp.py)
            agree([int(t) for t in toks])
        rows = [i for i, q in enumerate(questions) if not q.done]
        if any(self.sampled[i] and nans[i] for i in rows):
            raise BadInput("the model's logits hold NaN or +inf: there is nothing to sample from "
                           f"({why_not_finite(self.dtype)})")
        host = self.logits.detach().cpu() if self.logits is not None else None  # only where logits are kept
        for i in rows:
            q = questions[i]
            q.record(int(toks[i]), picked[i], None if q.answer.logits is None else host[i].clone(), max_positions,
                     self.next_pos[i])
        return [questions[i] for i in rows]


def choose_tokens(questions: list[Question], logits: torch.Tensor, draws: list[int] | None = None) -> Chosen:
    """Choose every question's next token from its row of this step's logits (Q, vocab), all at once, on the
    model's device, and start their copy to the host. `draws[i]`: the draw number of question i's random
    stream (default: the tokens it has; one more when the step before is not recorded yet)."""
    draws = [len(q.answer.token_ids) for q in questions] if draws is None else draws
    logp = torch.log_softmax(logits.float(), dim=-1)  # (Q, vocab)
    toks = torch.argmax(logits, dim=-1)  # (Q,) first maximal index
    sampled = [q.params.temperature != 0 for q in questions]
    if any(sampled):
        column = lambda values, dtype: to_device(torch.tensor(values, dtype=dtype), logits.device)  # noqa: E731
        drawn = sample_rows(logits, column([q.params.temperature or 1.0 for q in questions], torch.float64),
                            column([q.params.top_k for q in questions], torch.int64),
                            column([q.params.top_p for q in questions], torch.float64),
                            column([q.key for q in questions], torch.int64),
                            column(draws, torch.int64),
                            filtered=[s and bool(q.params.top_k or q.params.top_p < 1)  # the rows to sort
                                      for q, s in zip(questions, sampled)])
        toks = torch.where(column(sampled, torch.bool), drawn, toks)
    # a sampled row holding NaN or +inf has nothing to sample from (its softmax is NaN); greedy takes its first +inf
    nan = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)
    # Token ids, their log-probs and the NaN flags in one float64 tensor (all exact there): one copy to the host.
    host = Later(torch.stack([toks.double(), logp.gather(1, toks[:, None])[:, 0].double(), nan.double()]))
    keep = any(q.answer.logits is not None for q in questions)
    return Chosen(toks, host, sampled, logits if keep else None, [q.next_pos for q in questions], logits.dtype)


def take_tokens(questions: list[Question], logits: torch.Tensor, max_positions: int,
                agree: Callable[[list[int]], None] | None = None) -> None:
    """Pick and record every question's next token from its row of this step's logits (Q, vocab), all at once
    (`choose_tokens`, then `Chosen.record`)."""
    choose_tokens(questions, logits).record(questions, max_positions, agree)
