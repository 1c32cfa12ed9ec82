"""Continuous batching: one thread owns the model and the KV cache and runs one forward pass per step.

Each step packs, in one `model(tokens, positions, segments, cache)` call, the next token of every running
sequence (decode) with the prompt tokens of sequences that arrived since (prefill, up to `max_batch_tokens`
of them, or to the end of the rows the pass computes anyway, `Llama.rows_end`; a long prompt is fed over
several steps), exactly as parallel mode packs a document's questions, through the same `Llama.forward`
(step.py's host and device halves) that `generate` runs. A prompt's whole leading blocks come from the prefix
cache (prefix.py) when an earlier prompt computed them, what the prompts admitted together share past them from one
partial block, and the rest but the last token from one of its own; the last opens the segment where its answer grows.
Tokens are chosen and recorded as in `generate` (`tokens.choose_tokens`, `Chosen.record`), each sequence with
its own random stream `stream_key(seed, index)`, so its tokens and log-probs are those of `generate([prompt],
params, mode="independent")` (index 0; choice i of n: index i of n copies of the prompt), whatever else runs.

The HTTP side (app.py) talks to the engine only through `submit` and `cancel`; the engine reports each
sequence's progress through the sequence's `emit` callback, from its own thread. What one sequence does
after the forward pass (its filter, its sampler, its stop check, its report) can fail only that sequence
(`_record`, `_guarded`); only a failure of the shared pass itself fails every running sequence. On a GPU the
engine runs one pass ahead of the host (`_step`), with the same bits."""

from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..generate import SamplingParams
from ..tokens import Chosen, Question, choose_tokens, take_tokens
from ..model import Llama
from ..step import Pack
from ..transfer import to_device
from .logits import PromptLogprob, filtered, prompt_row_entries, top_entries
from .budget import Reservation, planned
from .prefix import Block, PrefixCache


class QueueFull(Exception):
    """More requests are waiting than the queue holds (HTTP 429)."""


class Stopped(Exception):
    """The engine is shutting down or has stopped (HTTP 503)."""


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
    # The request's own change to its row of logits before its token is picked (min_p, allowed_token_ids): row-wise
    logits_filter: Callable[[torch.Tensor], torch.Tensor] | None = None
    q: Question | None = field(default=None, repr=False)  # engine state, from here on
    blocks: list[Block] = field(default_factory=list)
    segment: int = -1
    tail: list[int] = field(default_factory=list)  # prompt tokens in its own segment
    fed: int = 0  # of them, computed (or scheduled)
    prompt_entries: list[PromptLogprob] = field(default_factory=list)  # echo: each prompt row's, as it came
    cancelled: bool = False
    finished: bool = False


@dataclass
class Launched:
    """A launched pass's picks (Engine._choose): the sequences, their rows of its logits, their tokens chosen on
    the device and on their way to the host (None: the choice raised; the host picks each alone)."""

    seqs: list[Choice]
    raw: torch.Tensor  # (Q, vocab)
    chosen: Chosen | None


class Engine:
    """The model's one owner. `start()` runs the loop in a thread; `stop()` ends it (running ones end with an error)."""

    def __init__(self, model: Llama, eos_ids: Sequence[int], max_running: int = 64, max_queue: int = 256,
                 max_batch_tokens: int = 512, max_memory_bytes: int = 0, prefix_cache: bool = True):
        self.model, self.eos = model, set(eos_ids)
        self.max_running, self.max_queue = max_running, max_queue
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.budget = max_memory_bytes
        self.cache = model.new_cache(256)
        self.prefix = PrefixCache(self.cache) if prefix_cache else None
        self.waiting: list[Choice] = []
        self.running: list[Choice] = []
        self.lock = threading.Condition()
        self.stopping = False
        self.pending: Launched | None = None  # the pass launched last, not read yet (one step ahead: `_step`)
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
        """Run the loop in the calling thread until `stop()`. `minillama serve` runs it on the model loader's thread:
        OpenMP keeps a team of worker threads per calling thread, and a second team beside the loader's made every pass
        1.7x slower on a 2-core machine (docs/serve.md, "One thread computes"). While it runs, `model.invariant` and
        `.units` refuse to change (`Steps.answering`): the run's cached blocks and answers share its kernels."""
        with self.lock:
            if self.owner is not None:
                raise RuntimeError("the engine's loop runs once")
            self.owner = threading.current_thread()
        try:
            self.model.steps.answering(self)  # this engine: its loop runs once
            self._loop()
        finally:
            self.model.steps.calls.discard(self)  # first, with no call before it: a Ctrl-C cannot come in between
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
        p = self.prefix
        return {"running": len(self.running), "waiting": len(self.waiting), "steps": self.steps,
                "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
                "cached_prefix_tokens": p.cached_tokens if p else 0, "prefix_hit_tokens": p.hits if p else 0,
                "evicted_blocks": p.evicted if p else 0, "kv_bytes": self.cache.used_bytes()}

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
                self.running, self.pending = [], None
                self.cache = self.model.new_cache(256)
                self.prefix = PrefixCache(self.cache) if self.prefix is not None else None
        with self.lock:
            for s in self.running + self.waiting:
                if not s.finished:
                    s.finished = True
                    s.emit(Event(error="the server is shutting down"))
            self.running, self.waiting = [], []

    def _admit(self) -> None:
        """Move waiting sequences to running (lock held) while the cache's bytes and all that those running and
        those admitted may still store (`budget.Reservation`) fit the budget; one always runs."""
        self.waiting = [s for s in self.waiting if not s.cancelled]
        admitted: list[Choice] = []
        held = Reservation(self.running, self.prefix, self.kv_per_token)
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            s = self.waiting[0]
            need = held.need(s)
            if (self.running or admitted) and self.budget and self.cache.used_bytes() + held.bytes + need > self.budget:
                if self.prefix is None or not self.prefix.evict(max(self.budget - held.bytes - need, 1)):
                    break
                held.recount()  # (what it evicted may be blocks the burst found cached)
                continue
            held.add(s, need)
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
        """One forward pass, and the tokens of the pass before or of this one recorded and reported: where the
        device runs apart from the host (a GPU: `Steps.overlapping`), one step ahead of it, as generate._decode
        runs: pass t + 1 is launched, its decode rows' token ids taken on the device from pass t's choice, before
        pass t's tokens are read back and reported, so the host's work of a step runs while the device computes."""
        with self.lock:
            for s in [s for s in self.running if s.cancelled]:
                self._finish(s, None)  # (one finished already: nothing)
            self.running = [s for s in self.running if not s.finished]
            if self.prefix is not None and self.budget:  # idle blocks make room for all that those running may add
                room = self.budget - planned(self.running, self.kv_per_token)  # (for one admitted alone too)
                self.prefix.evict(max(room, 1))
        if not self.running:
            self.pending = None  # every sequence in it has finished
            return
        launched = self._launch()
        in_step = not self.model.steps.overlapping(self.cache.k.device) or (launched and launched.chosen is None)
        # in step (or the device could not choose: the host picks each token, now), or one pass ahead
        order, self.pending = ([self.pending, launched], None) if in_step else ([self.pending], launched)
        for done in order:
            if done is not None:
                self._record(done)
        with self.lock:
            self.running = [s for s in self.running if not s.finished]

    def _launch(self) -> Launched | None:
        """Pack and launch a pass: the next token of every sequence that has one (first, those whose token the
        pass before chose and the host has not read: `self.pending`), then prompt tokens. Returns its picks,
        their tokens chosen on the device, or None when there was nothing to run."""
        pack = Pack()
        rows: list[int] = []  # rows whose logits are wanted
        decode: list[Choice] = []
        prefilled: list[tuple[Choice, int, int]] = []  # (sequence, its first wanted row, row count)
        max_pos = self.model.config.context
        ahead = [] if self.pending is None else [  # row i of the pending choice feeds decode row len(ahead)
            i for i, s in enumerate(self.pending.seqs) if not (s.finished or s.q.done) and not s.q.ends_by_length(
                len(s.q.answer.token_ids) + 1, max_pos)]
        unread = set() if self.pending is None else {id(s) for s in self.pending.seqs}
        for s in [self.pending.seqs[i] for i in ahead] + [s for s in self.running if id(s) not in unread]:
            if s.fed == len(s.tail) and not s.q.done:  # decode: one token each
                rows.append(pack.put(s.segment, s.q.next_pos, [0 if id(s) in unread else s.q.answer.token_ids[-1]]))
                decode.append(s)
        # Prompt tokens: `max_batch_tokens`, and as many more as fill the rows the pass computes anyway: whole
        # tiles of rows, in a bucket where steps are captured (a GPU's; `Llama.rows_end`).
        budget = self.model.rows_end(len(pack) + self.max_batch_tokens) - len(pack)
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
            return None
        ids, positions, segments = pack.tensors()
        if ahead:  # the pending choice's tokens, still on the device, then the host's
            device = self.pending.chosen.tokens.device
            ids = torch.cat([self.pending.chosen.tokens.index_select(0, to_device(torch.tensor(ahead), device)),
                             to_device(ids[len(ahead):], device)])
        logits = self.model(ids, positions, segments, self.cache,
                            logits_rows=torch.tensor(rows, dtype=torch.long))  # (len(rows), vocab)
        self.steps += 1
        self.decode_tokens += len(decode)
        self.prefill_tokens += len(pack) - len(decode)
        return self._choose(logits, decode, prefilled, unread)

    def _choose(self, logits: torch.Tensor, decode: list[Choice], prefilled: list[tuple[Choice, int, int]],
                unread: set[int]) -> Launched | None:
        """Choose, on the device, the next token of every sequence that has one this pass (`tokens.choose_tokens`;
        a sequence's `logits_filter` on its own row). logits: (rows, vocab); decode sequence i owns row i,
        prefilled ones (sequence, first row, count). If the choice raises, `chosen` is None: `_record` then
        picks each sequence's token alone, so that a failure is only its own."""
        picks: list[tuple[Choice, int]] = [(s, i) for i, s in enumerate(decode)]
        for s in decode:
            s.q.next_pos += 1
        for s, first, count in prefilled:
            if s.echo:  # every prompt row, reduced as it comes (its token's log-prob, rank, top-k: not the row)
                s.prompt_entries += prompt_row_entries(torch.log_softmax(logits[first:first + count].float(), -1),
                                                       s.prompt, len(s.prompt_entries), s.prompt_top_k)
            if s.fed < len(s.tail):
                continue
            s.q.next_pos = len(s.prompt)
            if s.q.done:  # max_tokens 0: the prompt only
                self._guarded(s, lambda s=s: self._finish(s, Event(finish_reason="length",
                                                                   prompt_logprobs=self._prompt_logprobs(s))))
                continue
            picks.append((s, first + count - 1))
        if not picks:
            return None
        seqs = [s for s, _ in picks]
        raw = logits.index_select(0, to_device(torch.tensor([r for _, r in picks]), logits.device))  # (Q, vocab)
        draws = [len(s.q.answer.token_ids) + (id(s) in unread) for s in seqs]  # a pending token is a draw
        try:
            chosen = choose_tokens([s.q for s in seqs], filtered([s.logits_filter for s in seqs], raw), draws)
        except Exception:
            chosen = None
        return Launched(seqs, raw, chosen)

    def _record(self, launched: Launched) -> None:
        """Record the launched pass's tokens (a sequence that has ended since is passed over, its row dropped)
        and report them. If anything in it raises (a sampler, a stop check, a filter), every sequence is put
        back as it was and takes its token alone: each step of `take_tokens` is row-wise, so the bits are the
        same, and a failure is the failure of the sequences it belongs to, never of the others."""
        keep = [i for i, s in enumerate(launched.seqs) if not (s.finished or s.q.done)]
        seqs, raw = [launched.seqs[i] for i in keep], launched.raw
        max_pos = self.model.config.context
        # (a random stream has no state to put back: its draw number is the tokens the answer holds)
        saved = [(len(s.q.answer.token_ids), s.q.answer.finish_reason, s.q.done) for s in seqs]
        alone = launched.chosen is None
        try:
            if not alone:
                launched.chosen.record([s.q for s in launched.seqs], max_pos)
                self._raw_logprobs(seqs, raw, keep)
        except Exception:  # find whose it is: every sequence again, alone
            alone = True
            for s, (n, reason, done) in zip(seqs, saved):
                a = s.q.answer
                del a.token_ids[n:], a.logprobs[n:]
                if a.logits is not None:
                    del a.logits[n:]
                a.finish_reason, s.q.done = reason, done
        for s, i in zip(seqs, keep) if alone else ():
            self._guarded(s, lambda s=s, i=i: (take_tokens([s.q], filtered([s.logits_filter], raw[i:i + 1]), max_pos),
                                               self._raw_logprobs([s], raw, [i])))
        want_top = [i for i, s in zip(keep, seqs) if s.top_k and not s.finished]
        top: dict[int, list[tuple[int, float]]] = {}
        if want_top:
            lp = torch.log_softmax(raw[want_top].float(), -1)  # row-wise: the bits of take_tokens's
            by_k: dict[int, list[int]] = {}  # rows of one k in one call: each row's entries are its own alone
            for j, i in enumerate(want_top):
                by_k.setdefault(launched.seqs[i].top_k, []).append(j)
            for k, rows in by_k.items():
                top.update(zip([want_top[j] for j in rows], top_entries(lp[rows], k)))
        for s, i in zip(seqs, keep):
            if not s.finished:  # those that failed were finished with their error
                self._guarded(s, lambda s=s, i=i: self._report(s, top.get(i)))

    @staticmethod
    def _raw_logprobs(seqs: list[Choice], raw: torch.Tensor, rows: Sequence[int]) -> None:
        """A filtered sequence's log-prob is the model's, of its raw row (raw[rows[i]] for seqs[i]), as any other's."""
        for s, i in zip(seqs, rows):
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
        """Echo / prompt_logprobs: the first token's empty entry, then the prompt rows' (reduced as they came)."""
        if not s.echo:
            return None
        entries, s.prompt_entries = s.prompt_entries, []
        return [(None, None, []), *entries]

    def _finish(self, s: Choice, ev: Event | None, quiet: bool = False) -> None:
        """Free the sequence's own segment and its hold on the prefix blocks; send its last event (`quiet`:
        an error event, whose own failure to send is only logged)."""
        if s.finished:
            return
        s.finished = True
        s.q.done = True  # a pass launched ahead of its end drops its row unread (Chosen.record)
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
