"""The KV cache's memory budget (`--max-memory`): what the sequences admitted may still store, in bytes.

The budget is a hard bound, kept by reservation: the engine admits a waiting sequence only while the cache's
bytes, all that the running sequences may still store (`planned`) and all that the sequences admitted in
the same call will store (`Reservation`) fit it, so no answer is ever cut short or recomputed for want of
room. A sequence stores its prompt's tokens (those the prefix cache stores once for the prompts admitted
together, once: `prefix.stored`) and its answer's but the last (`answer_tokens`)."""

from __future__ import annotations

from typing import Iterable, Protocol

from ..generate import SamplingParams
from ..tokens import Question
from .prefix import Block, PrefixCache, stored, unfilled


class Choice(Protocol):
    """What the budget reads of one of the engine's sequences (engine.Choice)."""

    prompt: list[int]
    params: SamplingParams
    echo: bool  # every prompt row computed: no prefix reuse
    q: Question | None
    blocks: list[Block]  # its prefix blocks, once running
    tail: list[int]  # prompt tokens in its own segment
    fed: int  # of them, computed (or scheduled)


def planned(running: Iterable[Choice], kv_per_token: int) -> int:
    """Bytes the running sequences may still store: prompt tokens not computed (a shared block once), answers."""
    running = list(running)
    return kv_per_token * (unfilled(s.blocks for s in running) + sum(
        len(s.tail) - s.fed + answer_tokens(s.params.max_new_tokens, max(s.q.next_pos - len(s.prompt), 0))
        for s in running))


def answer_tokens(max_new_tokens: int, fed: int = 0) -> int:
    """Answer tokens a sequence will still store, `fed` of them fed back already: every one but the last, which
    ends the answer and is never fed back (a pass fed token i + 1 after token i; a pass launched ahead of the host
    feeds no token that ends the answer by its length: `Engine._launch`)."""
    return max(max_new_tokens - 1 - fed, 0)


class Reservation:
    """The bytes reserved in one admission: those the running sequences may still store, and those of each
    sequence admitted so far in it. Prompts admitted together that share the prefix cache (not echo) count
    the tokens it stores once for them once."""

    def __init__(self, running: Iterable[Choice], prefix: PrefixCache | None, kv_per_token: int):
        self.prefix, self.kv_per_token = prefix, kv_per_token
        self.bytes = planned(running, kv_per_token)
        self.burst: list[list[int]] = []  # the prompts admitted so far that share the prefix cache
        self.stored = 0  # the tokens the prefix cache and their own segments newly store for them
        self.asked = 0  # the same with the prompt `need` was asked about last

    def need(self, s: Choice) -> int:
        """Bytes `s` would store beside the sequences admitted so far."""
        if self.prefix is None or s.echo:
            new = len(s.prompt)
        else:
            self.asked = self._stored(self.burst + [s.prompt])
            new = self.asked - self.stored  # shared: once
        return self.kv_per_token * (new + answer_tokens(s.params.max_new_tokens))

    def add(self, s: Choice, need: int) -> None:
        """`s`, whose `need` was asked last, is admitted: its need is reserved (the burst's count carried over)."""
        self.bytes += need
        if self.prefix is not None and not s.echo:
            self.burst.append(s.prompt)
            self.stored = self.asked

    def recount(self) -> None:
        """Count the burst again after an eviction: a block it found cached may be gone, to be computed again."""
        fresh = self._stored(self.burst)
        self.bytes += self.kv_per_token * (fresh - self.stored)
        self.stored = fresh

    def _stored(self, prompts: list[list[int]]) -> int:
        """Tokens the prefix cache and their own segments newly store for `prompts` admitted together: `stored`, less
        their whole blocks that the cache holds or a running sequence's reservation covers (`PrefixCache.found`).
        Partial blocks found cached are counted as new: which of them a burst takes, or splits, and how that
        regroups what its prompts share, is `acquire_all`'s to decide (a bound, not the exact figure)."""
        return stored(prompts) - self.prefix.found(prompts)
