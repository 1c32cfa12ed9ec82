"""Generation on token ids in three modes, and sampling (`python -m minillama.generate` is the CLI: cli.py).

- `independent`: each prompt alone, prefill then decode. The reference every other mode must match.
- `parallel` (the parallel-prompting paper): the shared document once, then every question as a child
  segment of it, all in one packed prefill; each decode step advances every unfinished question of every
  document in one forward pass. Bit-identical to `independent`, tokens and logits.
- `seqbatch` (the paper's baseline): one stream, the document, then question 1 and its answer, question 2
  and its answer, ... Each answer also sees the earlier ones, so it is not expected to match.

Prompts are token ids. Prompts of one document share their longest common token prefix: that prefix is
the document segment and the rest of each prompt is its question segment (tokenizing the document alone
could merge tokens differently at the boundary; docs/design.md). Sampling uses one random stream per question,
seeded from (seed, question index), so sampled answers also agree across modes.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m minillama.generate`: the `generate` command of `python -m minillama`,
    import sys  # handed over before this module's body runs as __main__ (minillama.cli imports the real one)

    from minillama.__main__ import main

    sys.exit(main(["generate", *sys.argv[1:]]))

import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from . import options
from .cache import KVCache
from .errors import check_device
from .model import Llama
from .sampling import sample_rows
from .step import Pack
from .tokens import NEEDS_TOKENIZER, Answer, Chosen, Question, StopStrings, choose_tokens, take_tokens
from .transfer import to_device

MODES = ("parallel", "independent", "seqbatch")
# Answer tokens per question a pass reserves cache slots for up front (KVCache.reserve, generate._slots).
RESERVED_ANSWER_TOKENS = 16


class StreamTooLong(ValueError):
    """seqbatch's one stream (the shared prefix, then every question and its answer) outgrew the context."""


@dataclass
class SamplingParams:
    """How each question's tokens are chosen and when its answer ends: the one carrier of these options from
    the command line and the API to `generate`. Each field is declared with its row of the option table
    (`options.option`: flag, help, checks), from which the command line's flags and every refusal come."""

    max_new_tokens: int = options.option(
        64, "--max-new-tokens", "most tokens per answer (default: 64)", options.INTEGER, options.at_least(0, ">= 0"),
        short="-n", metavar="N", parse=int)
    temperature: float = options.option(
        0.0, "--temperature", "0: greedy (default)", options.NUMBER,
        options.need(lambda t: options.is_finite(t) and t >= 0, "a finite number >= 0"),
        options.need(lambda t: t == 0 or float(t) > 0, "0 or above 0 as a float (a Fraction or long double too "
                     "small for one would be greedy)"), metavar="T", parse=float)
    top_k: int = options.option(
        0, "--top-k", "keep the K likeliest tokens (0: off)", options.INTEGER,
        options.need(lambda k: 0 <= k < 2**31, ">= 0 (0: off) and below 2**31"), metavar="K", parse=int)
    # Every top_p in (0, 1] keeps at least the likeliest token: the sampler compares it in float64, where no
    # positive number is 0 (sample_rows).
    top_p: float = options.option(
        1.0, "--top-p", "nucleus sampling, in (0, 1] (1: off)", options.NUMBER,
        options.need(lambda p: 0 < p <= 1, "in (0, 1] (1: off)"),
        options.need(lambda p: float(p) > 0, "above 0 as a float (a Fraction or long double too small for one)"),
        metavar="P", parse=float)
    seed: int = options.option(0, "--seed", "sampling seed (default: 0)", options.INTEGER,
                               options.need(lambda s: -2**63 <= s < 2**63, "a signed 64-bit integer"), parse=int)
    ignore_eos: bool = options.option(
        False, "--ignore-eos", "keep generating past end-of-sequence tokens", options.BOOLEAN, action="store_true")
    stop_token_ids: tuple[int, ...] = options.option(
        (), None, "stop an answer at these token ids",
        options.need(lambda ids: isinstance(ids, (list, tuple)) and all(options.is_int(i) and i >= 0 for i in ids),
                     "a list of token ids (integers >= 0)", options.BadType),
        no_flag="token ids are the Python API's; the command line stops at text (--stop)")
    # Called with a question's generated ids after each token; True stops it. Stop strings (one, or a list)
    # become a StopStrings.
    stop: Callable[[list[int]], bool] | None = options.option(
        None, "--stop", "stop an answer at this string (repeatable); the answer is cut before it",
        options.stops_or_function, options.non_empty_texts, metavar="STR", action="append", cli_default=[])
    keep_logits: bool = options.option(
        False, None, "keep every step's raw logits row (memory: vocab floats per token)", options.BOOLEAN,
        no_flag="the command line writes no logits; the oracle's export does (python -m minillama.oracle)")

    def __post_init__(self) -> None:
        for name, row in options.table(SamplingParams).items():
            setattr(self, name, row.check(name, getattr(self, name)))  # numpy's and torch's integers as Python's
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)  # a 0-d tensor's hash is its identity
        if not callable(self.stop):
            self.stop = StopStrings(options.strings(self.stop)) if options.strings(self.stop) else None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.stop.strings if isinstance(self.stop, StopStrings) else ()

    def with_tokenizer(self, tokenizer: Any, skip_special: bool = False) -> "SamplingParams":
        """These options with the stop strings' tokenizer bound (the same object when there are none), and
        whether the answer's text leaves control tokens out (`api.answer_text`'s skip_special)."""
        if not self.stop_strings:
            return self
        return replace(self, stop=StopStrings(self.stop_strings, tokenizer, skip_special))


@dataclass
class Stats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0  # tokens run through prefill (a shared document counts once)
    generated_tokens: int = 0
    forward_passes: int = 0
    peak_kv_bytes: int = 0

    @property
    def generate_s(self) -> float:
        return self.prefill_s + self.decode_s


def sample(logits: torch.Tensor, params: SamplingParams, key: int, step: int) -> int:
    """Pick the next token from one (vocab,) row of raw logits: draw `step` of stream `key` (sample_rows)."""
    if params.temperature == 0:
        return int(torch.argmax(logits))  # first maximal index
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=logits.device)  # noqa: E731
    return int(sample_rows(logits[None], one(params.temperature, torch.float64), one(params.top_k, torch.int64),
                           one(params.top_p, torch.float64), one(key, torch.int64), one(step, torch.int64))[0])


def _agreement(model: Llama) -> Callable[[list[int]], None] | None:
    """A tensor-parallel rank's check that every rank of its group chose the same tokens (None in one process)."""
    return getattr(model.kernels.comm, "agree", None)


def _run(model: Llama, cache: KVCache, pieces: list[tuple[int, int, Sequence[int]]], chunk: int,
         stats: Stats, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Run pieces (segment, first position, token ids) through the model, `chunk` tokens per pass at most.
    `tokens`: the packed token ids on the device instead of the pieces' (a decode step ahead of the host).

    Returns the logits rows of each piece's last token, (pieces, vocab).
    """
    pack = Pack()
    last = [pack.put(*piece) for piece in pieces]
    out = None  # the wanted rows (the last tokens are in increasing order), filled in pass by pass
    for lo in range(0, len(pack), chunk := max(chunk, 1)):
        hi = min(lo + chunk, len(pack))
        want = [i - lo for i in last if lo <= i < hi]
        ids, positions, segments = pack.tensors(lo, hi)
        logits = model(ids if tokens is None else tokens[lo:hi], positions, segments, cache,
                       logits_rows=torch.tensor(want, dtype=torch.long))
        stats.forward_passes += 1
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, cache.used_bytes())
        if len(want) == len(last):  # every wanted row in this one pass
            out = logits
        elif want:  # copied in as they come (a list of passes' rows and its concatenation held them twice)
            out = logits.new_empty(len(last), logits.shape[1]) if out is None else out
            out[sum(i < lo for i in last):][:len(want)] = logits
    return torch.empty(0, model.config.vocab_size) if out is None else out  # none: no tokens to run


def _decode(model: Llama, cache: KVCache, active: list[Question], stats: Stats,
            on_token: Callable[[int], None] | None, chosen: Chosen | None = None) -> None:
    """Advance every unfinished question by one token per forward pass until all are done; `chosen`: the
    prefill's choice of their first tokens, not read yet (decoding ahead of the host), or None.

    Where the device runs apart from the host (a GPU: `Steps.overlapping`), one step ahead of it: step t + 1
    is laid out and launched before step t's tokens are read back, its token ids taken on the device from
    step t's choice (`Chosen.tokens`), so that the host plans a step while the device computes the one
    before. A question that ends by its length or the context with step t's token is known to end before that token is
    read, and gets no row in step t + 1; one that step t stops (a stop token or string) has one already: that row is
    dropped unread, and rows being independent, no other row's bits change (tests/test_generate.py).
    """
    max_pos = model.config.context
    ahead = model.steps.overlapping(cache.k.device)
    live = [q for q in active if not q.done]
    feed = None  # the live questions' token ids on the device (the step before's choice), or None: the host's
    pending: tuple[list[Question], Chosen] | None = None  # the step launched last and not read yet
    if chosen is not None:
        pending = (active, chosen)
        live, feed = _next_step(active, chosen, max_pos)
    while live or pending:
        t0 = time.perf_counter()
        launched = None
        if live:
            logits = _run(model, cache, [(q.segment, q.next_pos, [0 if feed is not None else q.answer.token_ids[-1]])
                                         for q in live], len(live), stats, tokens=feed)
            for q in live:
                q.next_pos += 1
            launched = (live, choose_tokens(live, logits, [len(q.answer.token_ids) + (pending is not None)
                                                           for q in live]))
        if not ahead:
            pending, launched = launched, None
        if pending is not None:  # read the step before (ahead: now that this one is under way)
            _read(*pending, model, cache, stats, on_token)
        pending, feed = launched, None
        if launched is None:
            live = [q for q in live if not q.done]
        else:
            live, feed = _next_step(*launched, max_pos)
        stats.decode_s += time.perf_counter() - t0


def _read(step: list[Question], chosen: Chosen, model: Llama, cache: KVCache, stats: Stats,
          on_token: Callable[[int], None] | None) -> None:
    """Record a step's tokens (`Chosen.record`), free the segments of the questions they end, count them."""
    recorded = chosen.record(step, model.config.context, _agreement(model))
    for q in recorded:
        if q.done:
            cache.release(q.segment)
    stats.generated_tokens += len(recorded)
    if on_token and recorded:
        on_token(len(recorded))


def _next_step(step: list[Question], chosen: Chosen, max_pos: int) -> tuple[list[Question], torch.Tensor]:
    """The questions of the step after `step`, launched ahead of its read (those its tokens cannot end by
    length), and their token ids on the device: `chosen`'s rows of them."""
    keep = [i for i, q in enumerate(step) if not q.done and not q.ends_by_length(len(q.answer.token_ids) + 1, max_pos)]
    feed = chosen.tokens if len(keep) == len(step) else chosen.tokens.index_select(
        0, to_device(torch.tensor(keep, dtype=torch.long), chosen.tokens.device))
    return [step[i] for i in keep], feed


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Longest common token prefix, leaving every prompt at least one token of its own."""
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for i in range(max(n, 0)):
        if any(p[i] != first[i] for p in prompts):
            return i
    return max(n, 0)


def generate(model: Llama, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None,
             mode: str = "parallel", docs: Sequence[int] | None = None, parallel_size: int | None = None,
             batch_docs: int | None = None, eos_ids: Sequence[int] | None = None, prefill_chunk: int = 512,
             on_token: Callable[[int], None] | None = None, stats: Stats | None = None,
             on_answer: Callable[[int, Answer], None] | None = None,
             streams: Sequence[int] | None = None) -> list[Answer]:
    """Answer every prompt (token ids); returns one Answer per prompt, in order.

    docs[i] names the document prompt i belongs to (default: all one document); prompts of one document
    share their common prefix in parallel mode. parallel_size caps the questions decoded together per
    document, batch_docs the documents per forward pass (the paper's parallel size and batch size).
    on_answer(i, answer) is called as soon as prompt i's answer is finished (in finishing order), so a
    caller can stream answers out; a question with max_new_tokens = 0 is reported before any forward pass.
    streams[i] numbers prompt i's random stream (default i): a share of a larger run keeps the run's streams.
    Threads may share a model (each answer its solo bits); meanwhile model.invariant = ... raises RuntimeError.
    """
    params = params or SamplingParams()
    stats = stats if stats is not None else Stats()
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    for name, v in (("parallel_size", parallel_size), ("batch_docs", batch_docs), ("prefill_chunk", prefill_chunk)):
        if v is not None and (not options.is_int(v) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1 (or None), got {v!r}")  # else answers come back empty
    parallel_size, batch_docs, prefill_chunk = (None if v is None else int(v)  # numpy's int8 wraps at 127
                                                for v in (parallel_size, batch_docs, prefill_chunk))
    for name, f in (("on_token", on_token), ("on_answer", on_answer)):
        if f is not None and not callable(f):  # else it fails after the prefill, naming neither
            raise TypeError(f"{name} must be a function or None, got {f!r}")
    prompts, docs, streams, params = _checked(model, prompts, params, docs, streams, stats, eos_ids)
    if not prompts:
        return []
    eos = {int(t) for t in (model.config.eos_token_ids if eos_ids is None else eos_ids)}  # as stop_token_ids
    questions = [Question(i, params, eos, on_answer, None if streams is None else streams[i])
                 for i in range(len(prompts))]
    if on_answer is not None:
        for q in questions:
            if q.done:  # max_new_tokens == 0: finished before it starts
                on_answer(q.index, q.answer)
    call = object()  # this call, under way (Steps.answering): model.invariant and .units refuse to change
    try:
        model.steps.answering(call)
        if mode == "independent":
            for q, p in zip(questions, prompts):
                _prefill_and_decode(model, [(q, p, None)], None, prefill_chunk, stats, on_token)
        elif mode == "seqbatch":
            for d in dict.fromkeys(docs):
                _seqbatch(model, [q for q, dd in zip(questions, docs) if dd == d],
                          [p for p, dd in zip(prompts, docs) if dd == d], prefill_chunk, stats, on_token)
        else:
            order = list(dict.fromkeys(docs))
            for b in range(0, len(order), per_batch := batch_docs or len(order)):
                _parallel(model, prompts, questions, docs, order[b:b + per_batch], parallel_size, prefill_chunk,
                          stats, on_token)
    finally:
        model.steps.calls.discard(call)  # first, with no call before it: a Ctrl-C cannot come in between
    return [q.answer for q in questions]


def _checked(model: Any, prompts: Any, params: Any, docs: Any, streams: Any, stats: Any, eos_ids: Any = None
             ) -> tuple[list[list[int]], list[Any], list[int] | None, SamplingParams]:
    """`generate`'s arguments, each refused naming it (ValueError, TypeError) rather than met inside torch: the
    prompts as lists of ints in the vocabulary and shorter than the context, one document and stream each."""
    for name, v, kind in (("model", model, Llama), ("params", params, SamplingParams), ("stats", stats, Stats)):
        if not isinstance(v, kind):
            raise options.BadType(f"{name} must be a {kind.__name__}, got {type(v).__name__}"
                                  + (" (a loaded model's .llama)" if name == "model" else ""))
    # A model moved where it cannot compute (`model.to("meta")`) as load(device=...) refuses it, not deep in a pass
    check_device(str(next((t.device for t in model.parameters() if t.is_meta), model.device)), "model device")
    params = replace(params)  # checked again: a field set after it was made (p.temperature = nan) was trusted
    if params.stop_strings and params.stop.tokenizer is None:  # else it fails after the prefill
        raise ValueError(NEEDS_TOKENIZER)
    if not isinstance(prompts, (list, tuple)):
        raise options.BadType(f"prompts must be a list of token id lists, got {type(prompts).__name__}")
    vocab, max_pos, out = model.config.vocab_size, model.config.context, []
    for i, p in enumerate(prompts):
        ids = p.tolist() if hasattr(p, "dtype") else p  # a tensor or an array
        if not isinstance(ids, (list, tuple)) or not all(type(t) is int or options.is_int(t) for t in ids):
            raise options.BadType(f"prompt {i} must be a list of integer token ids, got {repr(p)[:80]}")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if not 0 <= min(ids) <= max(ids) < vocab:
            raise ValueError(f"prompt {i}: token ids must be in 0 .. {vocab - 1}, got {min(ids)} .. {max(ids)}")
        if len(ids) >= max_pos:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the model's context is {max_pos}")
        out.append([int(t) for t in ids])
    for name, v in (("docs", docs), ("streams", streams)):
        if v is not None and (not hasattr(v, "__len__") or len(v) != len(out)):
            raise ValueError(f"{name} must name one for each of the {len(out)} prompts, got {repr(v)[:80]}")
    if streams is not None and not all(options.is_int(k) and k >= 0 for k in streams):
        raise ValueError(f"streams must be integers >= 0, got {repr(streams)[:80]}")
    if docs is not None and not all(isinstance(d, Hashable) for d in docs):
        raise options.BadType(f"docs must name each prompt's document (an integer), got {repr(docs)[:80]}")
    for name, ids in (("eos_ids", eos_ids), ("stop_token_ids", params.stop_token_ids)):
        if ids is not None and (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
                                or not all(options.is_int(t) for t in ids)):
            raise options.BadType(f"{name} must be a list of integer token ids, got {repr(ids)[:80]}")
        if name == "stop_token_ids" and not all(0 <= t < vocab for t in ids):
            raise ValueError(f"{name} must be in 0 .. {vocab - 1} (the model's vocabulary), got {repr(ids)[:80]}")
        # An EOS id past the vocabulary never comes, and is let be: a tokenizer may list one beside an id inside
        # it (Tokenizer.check_fits), and its callers pass the tokenizer's ids. A negative id is no token at all.
        if name == "eos_ids" and ids is not None and not all(t >= 0 for t in ids):
            raise ValueError(f"{name} must be token ids >= 0, got {repr(ids)[:80]}")
    return (out, [0] * len(out) if docs is None else list(docs), None if streams is None else list(map(int, streams)),
            params)


def _slots(work: list[tuple[Question, Sequence[int], int | None]]) -> int:
    """Cache slots to reserve for prefilling `work` and its first answer tokens (KVCache.reserve)."""
    return sum(len(ids) + min(q.params.max_new_tokens, RESERVED_ANSWER_TOKENS) for q, ids, _ in work)


def _prefill_and_decode(model: Llama, work: list[tuple[Question, Sequence[int], int]], cache: KVCache | None,
                        chunk: int, stats: Stats, on_token) -> None:
    """Prefill each (question, its own token ids, parent segment or None), then decode them together."""
    if cache is None:
        cache = model.new_cache()
        cache.reserve(_slots(work))
    pieces = []
    for q, ids, parent in work:
        q.segment = cache.new_segment(parent)
        start = cache.length(q.segment)
        pieces.append((q.segment, start, ids))
        q.next_pos = start + len(ids)
    t0 = time.perf_counter()
    live = [(q, piece) for q, piece in zip((w[0] for w in work), pieces) if not q.done]
    chosen = None  # their first tokens: read now, or, one step ahead of the host, once the first decode step runs
    if live:
        chosen = choose_tokens([q for q, _ in live], _run(model, cache, [piece for _, piece in live], chunk, stats))
    stats.prompt_tokens += sum(len(piece[2]) for _, piece in live)
    if chosen is not None and not model.steps.overlapping(cache.k.device):
        _read([q for q, _ in live], chosen, model, cache, stats, on_token)
        chosen = None
    stats.prefill_s += time.perf_counter() - t0
    _decode(model, cache, [q for q, _ in live], stats, on_token, chosen)


def _parallel(model, prompts, questions, docs, batch, parallel_size, chunk, stats, on_token) -> None:
    cache = model.new_cache()
    t0 = time.perf_counter()
    waves: list[list[tuple[Question, Sequence[int], int]]] = []
    doc_pieces = []
    for d in batch:
        idx = [i for i, dd in enumerate(docs) if dd == d]
        shared = shared_prefix_length([prompts[i] for i in idx])
        seg = cache.new_segment()
        if shared and not all(questions[i].done for i in idx):  # no document is read for no answer (-n 0)
            doc_pieces.append((seg, 0, prompts[idx[0]][:shared]))
        size = parallel_size or len(idx)
        for w, lo in enumerate(range(0, len(idx), size)):
            while len(waves) <= w:
                waves.append([])
            waves[w].extend((questions[i], prompts[i][shared:], seg) for i in idx[lo:lo + size])
    # The cache sized once for the prompts (every document, then the largest wave's questions) and the
    # first few answer tokens; longer answers grow it as they go.
    cache.reserve(sum(len(p[2]) for p in doc_pieces) + max(map(_slots, waves), default=0))
    # Documents first (questions attach to their full length), chunked like any prefill.
    _run(model, cache, doc_pieces, chunk, stats)
    stats.prompt_tokens += sum(len(p[2]) for p in doc_pieces)
    stats.prefill_s += time.perf_counter() - t0
    for wave in waves:
        _prefill_and_decode(model, wave, cache, chunk, stats, on_token)


def _seqbatch(model, questions, prompts, chunk, stats, on_token) -> None:
    """One stream: shared prefix, then each question's own tokens followed by its generated answer."""
    cache = model.new_cache()
    shared = shared_prefix_length(prompts) if len(prompts) > 1 else len(prompts[0]) - 1
    seg = cache.new_segment()
    max_pos = model.config.context
    pending = list(prompts[0][:shared])
    for q, p in zip(questions, prompts):
        pending.extend(p[shared:])
        if q.done:  # max_new_tokens == 0: nothing to generate; the question joins what the next answer follows
            continue
        if cache.length(seg) + len(pending) >= max_pos:  # what runs, when something runs: no pass, no overflow
            raise StreamTooLong(f"seqbatch stream is longer than the model's context ({max_pos})")
        t0 = time.perf_counter()
        logits = _run(model, cache, [(seg, cache.length(seg), pending)], chunk, stats)
        stats.prompt_tokens += len(pending)
        stats.prefill_s += time.perf_counter() - t0
        q.next_pos = cache.length(seg)
        take_tokens([q], logits, max_pos, _agreement(model))
        stats.generated_tokens += 1
        if on_token:
            on_token(1)
        q.segment = seg
        while not q.done:
            t0 = time.perf_counter()
            logits = _run(model, cache, [(seg, q.next_pos, [q.answer.token_ids[-1]])], 1, stats)
            q.next_pos += 1
            take_tokens([q], logits, max_pos, _agreement(model))
            stats.decode_s += time.perf_counter() - t0
            stats.generated_tokens += 1
            if on_token:
                on_token(1)
        pending = [q.answer.token_ids[-1]]  # the last answer token has not been run yet

