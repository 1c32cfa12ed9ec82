"""Continuous batching: one thread owns the model and the KV cache and runs one forward pass per step.

Each step packs, in one `model(tokens, positions, segments, cache)` call, the next token of every running
sequence (decode) with the prompt tokens of sequences that arrived since (prefill, up to `max_batch_tokens`
of them, or to the end of the pass's last row tile; a long prompt is fed over several steps), exactly as
parallel mode packs a document's questions, through the same `Llama.forward` (step.py's host and device
halves) that `generate` runs. A prompt's whole leading blocks come from the prefix cache (prefix.py) when
an earlier prompt computed them, and the tokens that the prompts admitted together share past those blocks
from one partial block; its other tokens go into its own segment, where its answer grows. Tokens are picked by
`tokens.take_tokens`, with each sequence's own random stream `stream_key(seed, index)`, so a
sequence's tokens and log-probs are those of `generate([prompt], params, mode="independent")` (index 0;
choice i of a request with n choices: index i of n copies of the prompt), whatever else is in the pass.

The HTTP side (app.py) talks to the engine only through `submit` and `cancel`; the engine reports each
sequence's progress through the sequence's `emit` callback, from its own thread. What one sequence does
after the forward pass (its filter, its sampler, its stop check, its report) can fail only that sequence
(`_pick`, `_guarded`); only a failure of the shared pass itself fails every running sequence.
"""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..generate import SamplingParams
from ..tokens import Question, take_tokens
from ..model import Llama
from ..step import Pack
from .prefix import Block, PrefixCache


class QueueFull(Exception):
    """More requests are waiting than the queue holds (HTTP 429)."""


class Stopped(Exception):
    """The engine is shutting down or has stopped (HTTP 503)."""


# A prompt token's (log-prob, rank, top-k (token id, log-prob) pairs); (None, None, []) for the first.
PromptLogprob = tuple[float | None, int | None, list[tuple[int, float]]]


@dataclass
class Event:
    """What one step did for one sequence: its new token (None for a prompt-only step) and, at the end,
    its finish reason. `prompt_logprobs` (echo) come once, with the first event."""

    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # the top-k (token id, log-prob) at this token
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    error: str | None = None


@dataclass(eq=False)
class Choice:
    """One choice of one request: its prompt, sampling parameters and where its events go."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Event], None]
    index: int = 0  # its random stream: stream_key(params.seed, index)
    top_k: int = 0  # top log-probs wanted per token (0: none)
    echo: bool = False  # the prompt's own log-probs are wanted (no prefix reuse: every row is computed)
    prompt_top_k: int = 0  # with echo: top log-probs wanted per prompt token
    # A request's own change to its row of logits before its token is picked (min_p, allowed_token_ids);
    # row-wise, so a sequence's bits still do not depend on the others.
    logits_filter: Callable[[torch.Tensor], torch.Tensor] | None = None
    # engine state
    q: Question | None = field(default=None, repr=False)
    blocks: list[Block] = field(default_factory=list)
    segment: int = -1
    tail: list[int] = field(default_factory=list)  # prompt tokens in its own segment
    fed: int = 0  # of them, computed (or scheduled)
    prompt_rows: list[torch.Tensor] = field(default_factory=list)  # echo: log-softmax rows, in order
    cancelled: bool = False
    finished: bool = False


class Engine:
    """The model's one owner. `start()` runs the loop in a thread; `stop()` ends it (running sequences
    finish with an error event)."""

    def __init__(self, model: Llama, eos_ids: Sequence[int], max_running: int = 64, max_queue: int = 256,
                 max_batch_tokens: int = 512, max_memory_bytes: int = 0, prefix_cache: bool = True):
        self.model = model
        self.eos = set(eos_ids)
        self.max_running, self.max_queue = max_running, max_queue
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.budget = max_memory_bytes
        self.cache = model.new_cache(256)
        self.prefix = PrefixCache(self.cache) if prefix_cache else None
        self.waiting: list[Choice] = []
        self.running: list[Choice] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None  # the loop's own thread, when `start()` made one
        self.owner: threading.Thread | None = None  # the thread running the loop (`run`), once it started
        self.ended = threading.Event()  # the loop has ended
        self.steps = self.prefill_tokens = self.decode_tokens = 0
        self.kv_per_token = model.config.kv_bytes_per_token(model.dtype.itemsize)

    # --- the HTTP side's calls (any thread) -----------------------------------------------------------
    def submit(self, seqs: list[Choice]) -> None:
        """Queue a request's sequences (all or none). Raises QueueFull or Stopped."""
        with self.lock:
            if self.stopping:
                raise Stopped("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise QueueFull(f"the server is busy: {len(self.waiting)} sequences are waiting "
                                f"(--max-queue {self.max_queue}); retry later")
            self.waiting.extend(seqs)
            self.lock.notify()

    def cancel(self, seqs: list[Choice]) -> None:
        """The client went away: its sequences leave at the next step and free their slots."""
        with self.lock:
            for s in seqs:
                s.cancelled = True
            self.lock.notify()

    def start(self) -> "Engine":
        """Run the loop in a thread of its own (an engine inside another program: the tests, the bench)."""
        self.thread = threading.Thread(target=self.run, name="minillama-engine", daemon=True)
        self.thread.start()
        return self

    def run(self) -> None:
        """Run the loop in the calling thread until `stop()`. `minillama serve` runs it on the thread that
        loaded the model, its main thread: a CPU's OpenMP runtime keeps one team of worker threads per thread
        that calls into it, and a second team beside the loader's made every pass 1.7x slower on a 2-core
        machine (docs/serve.md, "One thread computes")."""
        with self.lock:
            if self.owner is not None:
                raise RuntimeError("the engine's loop runs once")
            self.owner = threading.current_thread()
        try:
            self._loop()
        finally:
            self.ended.set()

    @property
    def alive(self) -> bool:
        """The loop is running and not asked to stop."""
        return self.owner is not None and not self.ended.is_set() and not self.stopping

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end (running sequences end with an error event) and wait up to `timeout` seconds
        for it, unless it is the caller's own loop or never ran."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
            owner = self.owner
        if owner is not None and owner is not threading.current_thread():
            self.ended.wait(timeout)
            if owner is self.thread:
                owner.join(timeout)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting), "steps": self.steps,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "cached_prefix_tokens": self.prefix.cached_tokens if self.prefix else 0,
                "prefix_hit_tokens": self.prefix.hits if self.prefix else 0,
                "evicted_blocks": self.prefix.evicted if self.prefix else 0,
                "kv_bytes": self.cache.used_bytes()}

    # --- the engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.running:
                    self.lock.wait()
                if self.stopping:
                    break
                self._admit()
            try:
                self._step()
            except Exception:  # a bug in the shared pass: report it, fail what is running, keep serving
                traceback.print_exc(file=sys.stderr)
                for s in self.running:
                    self._finish(s, Event(error="internal error in the engine (see the server's log)"))
                self.running = []
                self.cache = self.model.new_cache(256)
                self.prefix = PrefixCache(self.cache) if self.prefix is not None else None
        with self.lock:
            for s in self.running + self.waiting:
                if not s.finished:
                    s.finished = True
                    s.emit(Event(error="the server is shutting down"))
            self.running, self.waiting = [], []

    def _admit(self) -> None:
        """Move waiting sequences to running while there is room (called with the lock held)."""
        self.waiting = [s for s in self.waiting if not s.cancelled]
        admitted: list[Choice] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            s = self.waiting[0]
            need = self.kv_per_token * (len(s.prompt) + s.params.max_new_tokens)
            if (self.running or admitted) and self.budget and self.cache.used_bytes() + need > self.budget:
                if self.prefix is None or not self.prefix.evict(max(self.budget - need, 1)):
                    break
                continue
            admitted.append(self.waiting.pop(0))
        self._place(admitted)
        self.running.extend(admitted)

    def _place(self, seqs: list[Choice]) -> None:
        """Give each admitted sequence its prefix blocks (those admitted together share a partial block for
        the tokens they share past their whole blocks: prefix.acquire_all) and its own segment below them."""
        shared = [s for s in seqs if self.prefix is not None and not s.echo]
        chains = dict(zip(map(id, shared), self.prefix.acquire_all([s.prompt for s in shared]))) if shared else {}
        for s in seqs:
            s.q = Question(s.index, s.params, self.eos)
            s.blocks = chains.get(id(s), [])
            s.tail = s.prompt[s.blocks[-1].end if s.blocks else 0:]
            s.segment = self.cache.new_segment(s.blocks[-1].segment if s.blocks else None)
            s.q.segment = s.segment

    def _step(self) -> None:
        with self.lock:
            for s in self.running:
                if s.cancelled and not s.finished:
                    self._finish(s, None)
            self.running = [s for s in self.running if not s.finished]
        if not self.running:
            return
        pack = Pack()
        rows: list[int] = []  # rows whose logits are wanted
        decode: list[Choice] = []
        prefilled: list[tuple[Choice, int, int]] = []  # (sequence, its first wanted row, row count)
        for s in self.running:  # decode: one token each
            if s.fed == len(s.tail) and not s.q.done:
                rows.append(pack.put(s.segment, s.q.next_pos, [s.q.answer.token_ids[-1]]))
                decode.append(s)
        # Prompt tokens: `max_batch_tokens`, and as many more as fill the pass's last row tile: an invariant
        # pass computes whole tiles of rows (invariant.Tiles.tile_end), so rows up to the tile's end cost nothing.
        budget = self.model.kernels.tile_end(len(pack) + self.max_batch_tokens, self.model.device) - len(pack)
        for s in self.running:  # prefill, in arrival order, parents before children
            if budget <= 0:
                break
            if s.fed == len(s.tail):
                continue
            blocked = False
            for b in s.blocks:
                if not b.ready:
                    take = min(budget, len(b.tokens) - b.filled)
                    pack.put(b.segment, b.position + b.filled, b.tokens[b.filled:b.filled + take])
                    b.filled += take
                    budget -= take
                    if not b.ready:
                        blocked = True
                        break
            if blocked or budget <= 0:
                continue
            take = min(budget, len(s.tail) - s.fed)
            start = len(s.prompt) - len(s.tail)
            first = len(pack)
            last = pack.put(s.segment, start + s.fed, s.tail[s.fed:s.fed + take])
            s.fed += take
            budget -= take
            if s.echo:
                rows.extend(range(first, last + 1))
                prefilled.append((s, len(rows) - take, take))
            elif s.fed == len(s.tail):
                rows.append(last)
                prefilled.append((s, len(rows) - 1, 1))
        if not len(pack):
            return
        logits = self.model(*pack.tensors(), self.cache,
                            logits_rows=torch.tensor(rows, dtype=torch.long))  # (len(rows), vocab)
        self.steps += 1
        self.decode_tokens += len(decode)
        self.prefill_tokens += len(pack) - len(decode)
        self._take(logits, decode, prefilled)
        with self.lock:
            self.running = [s for s in self.running if not s.finished]
            if self.prefix is not None and self.budget:
                self.prefix.evict(self.budget)

    def _take(self, logits: torch.Tensor, decode: list[Choice], prefilled: list[tuple[Choice, int, int]]) -> None:
        """Pick the next token of every sequence that has one this step, then report to each.
        logits: (rows, vocab); decode sequence i owns row i, prefilled ones (sequence, first row, count)."""
        picks: list[tuple[Choice, int]] = [(s, i) for i, s in enumerate(decode)]
        for s in decode:
            s.q.next_pos += 1
        for s, first, count in prefilled:
            if s.echo:  # every prompt row, kept until the prompt is complete
                s.prompt_rows.append(torch.log_softmax(logits[first:first + count].float(), -1))
            if s.fed < len(s.tail):
                continue
            s.q.next_pos = len(s.prompt)
            if s.q.done:  # max_tokens 0: the prompt only
                self._guarded(s, lambda s=s: self._finish(s, Event(finish_reason="length",
                                                                   prompt_logprobs=self._prompt_logprobs(s))))
                continue
            picks.append((s, first + count - 1))
        if not picks:
            return
        raw = logits[torch.tensor([r for _, r in picks])]  # (Q, vocab)
        seqs = self._pick([s for s, _ in picks], raw)
        want_top = [i for i, s in enumerate(seqs) if s.top_k and not s.finished]
        top: dict[int, list[tuple[int, float]]] = {}
        if want_top:
            lp = torch.log_softmax(raw[torch.tensor(want_top)].float(), -1)  # row-wise: the bits of take_tokens's
            k = max(seqs[i].top_k for i in want_top)
            vals, ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
            for j, i in enumerate(want_top):
                kk = seqs[i].top_k
                top[i] = list(zip(ids[j, :kk].tolist(), vals[j, :kk].tolist()))
        for i, s in enumerate(seqs):
            if not s.finished:  # those that failed were finished with their error
                self._guarded(s, lambda s=s, i=i: self._report(s, top.get(i)))

    def _pick(self, seqs: list[Choice], raw: torch.Tensor) -> list[Choice]:
        """`take_tokens` over the rows of all `seqs` at once (raw: (Q, vocab), a sequence's `logits_filter`
        applied to its own row). If anything in it raises (a sampler, a stop check, a filter), every sequence
        is put back as it was and takes its token alone: each step of `take_tokens` is row-wise, so the bits
        are the same, and a failure is the failure of the sequences it belongs to, never of the others."""
        max_pos = self.model.config.max_position_embeddings
        # (a random stream has no state to put back: its draw number is the tokens the answer holds)
        saved = [(len(s.q.answer.token_ids), s.q.answer.finish_reason, s.q.done) for s in seqs]
        try:
            take_tokens([s.q for s in seqs], self._filtered(seqs, raw), max_pos)
            self._raw_logprobs(seqs, raw)
            return seqs
        except Exception:  # find whose it is: every sequence again, alone
            for s, (n, reason, done) in zip(seqs, saved):
                a = s.q.answer
                del a.token_ids[n:], a.logprobs[n:]
                if a.logits is not None:
                    del a.logits[n:]
                a.finish_reason, s.q.done = reason, done
        for i, s in enumerate(seqs):
            self._guarded(s, lambda s=s, i=i: (take_tokens([s.q], self._filtered([s], raw[i:i + 1]), max_pos),
                                               self._raw_logprobs([s], raw[i:i + 1])))
        return seqs

    @staticmethod
    def _filtered(seqs: list[Choice], raw: torch.Tensor) -> torch.Tensor:
        """The rows tokens are picked from: a sequence's `logits_filter` (a request's min_p or
        allowed_token_ids) applied to its own row, the other rows as they are."""
        if not any(s.logits_filter for s in seqs):
            return raw
        rows = raw.clone()
        for i, s in enumerate(seqs):
            if s.logits_filter is not None:
                rows[i] = s.logits_filter(raw[i])
        return rows

    @staticmethod
    def _raw_logprobs(seqs: list[Choice], raw: torch.Tensor) -> None:
        """A filtered sequence's log-prob is the model's, of its raw row (as every other sequence's)."""
        for i, s in enumerate(seqs):
            if s.logits_filter is not None:
                a = s.q.answer
                a.logprobs[-1] = float(torch.log_softmax(raw[i].float(), dim=-1)[a.token_ids[-1]])

    def _report(self, s: Choice, top: list[tuple[int, float]] | None) -> None:
        a = s.q.answer
        ev = Event(a.token_ids[-1], a.logprobs[-1], top)
        if len(a.token_ids) == 1 and s.echo:
            ev.prompt_logprobs = self._prompt_logprobs(s)
        if s.q.done:
            ev.finish_reason = a.finish_reason
            self._finish(s, ev)
        else:
            s.emit(ev)

    def _guarded(self, s: Choice, work: Callable[[], object]) -> None:
        """Run one sequence's own work; if it raises, that sequence alone ends with an error (HTTP 500 to its
        client) and the traceback goes to the server's log."""
        try:
            work()
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self._finish(s, Event(error=f"internal error in the engine for this request ({type(e).__name__}: "
                                        f"{e}); see the server's log"), quiet=True)

    def _prompt_logprobs(self, s: Choice) -> list[PromptLogprob] | None:
        """Echo / prompt_logprobs: each prompt token's log-prob given the tokens before it and its rank
        there (1: the likeliest; None for the first token), with the top-k at its position."""
        if not s.echo:
            return None
        lp = torch.cat(s.prompt_rows)  # (P, vocab): row t predicts prompt token t + 1
        s.prompt_rows = []
        nxt = torch.tensor(s.prompt[1:], dtype=torch.long)
        picked = lp[:-1].gather(1, nxt[:, None])  # (P - 1, 1)
        chosen = picked[:, 0].tolist()
        ranks = ((lp[:-1] > picked).sum(dim=1) + 1).tolist()
        out: list[PromptLogprob] = [(None, None, [])]
        if s.prompt_top_k and len(nxt):
            vals, ids = lp[:-1].topk(min(s.prompt_top_k, lp.shape[-1]), dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        else:
            tops = [[] for _ in chosen]
        out.extend(zip(chosen, ranks, tops))
        return out

    def _finish(self, s: Choice, ev: Event | None, quiet: bool = False) -> None:
        """Free the sequence's own segment and its hold on the prefix blocks; send its last event (`quiet`:
        an error event, whose own failure to send is only logged)."""
        if s.finished:
            return
        s.finished = True
        if s.segment in self.cache.segments:
            self.cache.release(s.segment)
        if self.prefix is not None and s.blocks:
            self.prefix.release(s.blocks)
        if ev is None:
            return
        try:
            s.emit(ev)
        except Exception:
            if not quiet:
                raise
            traceback.print_exc(file=sys.stderr)
