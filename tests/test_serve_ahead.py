"""The engine one pass ahead of the host (`Steps.overlap`, a GPU's default): pass t + 1 is launched, its decode
rows' tokens taken on the device from pass t's choice, before pass t's tokens are read and reported.

Driven step by step on a CPU with the overlap forced on: every sequence's events (tokens, log-probs, top
log-probs, prompt log-probs, finish reasons) are those of the engine in step, for a mix of what requests ask
(greedy and sampled, filters, stop ids and stop rules, echo, no new tokens, arrivals mid-run, one that a
stop rule's failure ends and one whose sampler fails), with plain copies and with the GPU's (pinned, read
behind an event); and the reads come one pass late. Negative control:
with the engine before this change, a forced overlap leaves the engine in step (the order test fails).
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from minillama import tokens as tokens_module
from minillama.generate import SamplingParams, generate
from minillama.serve.engine import Choice, Engine, Event
from minillama.serve.identity import eos_of
from minillama.serve.logits import row_filter
from _serve_harness import ckpt, model  # noqa: F401 (fixtures)
from test_generate import unwaited_copies

VICTIM = 4242  # the planted sampler raises for this seed's stream alone


def _choices(model, doc: list[int]) -> list[tuple[int, Choice]]:
    """(the pass it arrives before, its choice): one per kind of request, events gathered in `events`."""
    vocab = model.llama.config.vocab_size
    free = SamplingParams(max_new_tokens=9, ignore_eos=True)
    seen = generate(model.llama, [doc + [7]], free, mode="independent")[0].token_ids  # request 2's greedy answer
    sampled = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=3, top_k=40, top_p=0.9)
    kinds = [
        (0, free, {}),
        (0, sampled, {"index": 1, "top_k": 3}),
        (0, dataclasses.replace(free, stop_token_ids=(seen[3],)), {}),  # a stop id at its 4th token (or before)
        (0, dataclasses.replace(free, stop=lambda ids: len(ids) == 2), {}),  # a stop rule at its 2nd
        (0, dataclasses.replace(sampled, seed=VICTIM), {}),  # its sampler fails: it alone ends in error
        (1, dataclasses.replace(free, max_new_tokens=0), {"echo": True, "prompt_top_k": 2}),
        (1, dataclasses.replace(free, max_new_tokens=1), {"top_k": 2}),
        (2, dataclasses.replace(sampled, seed=9), {"logits_filter": row_filter(vocab, 0.9, min_p=0.1)}),
        (2, free, {"logits_filter": row_filter(vocab, 0.0, allowed=[7, 8, 9, 10, 11])}),
        (3, dataclasses.replace(free, max_new_tokens=5), {"echo": True}),
        (3, dataclasses.replace(free, stop=lambda ids: 1 / 0 if len(ids) == 3 else False), {}),  # fails at its 3rd
    ]
    return [(when, Choice(doc + [5 + i], params, None, **extra)) for i, (when, params, extra) in enumerate(kinds)]


def _serve(model, ahead: bool, monkeypatch, unwaited: bool = False) -> tuple[list[list[Event]], dict]:
    """Every choice's events, the engine stepped on this thread with the overlap forced on or off (`unwaited`:
    and with the GPU's copies, test_generate.unwaited_copies, each event waited on once)."""
    real = tokens_module.sample_rows
    pinned, waits = unwaited_copies(monkeypatch) if unwaited else ([], [])

    def sample(logits, temperature, top_k, top_p, keys, *args, **kwargs):
        if any(int(k) // 1_000_003 == VICTIM for k in keys):  # stream_key(seed, index), index small
            raise RuntimeError("planted sampler failure")
        return real(logits, temperature, top_k, top_p, keys, *args, **kwargs)

    monkeypatch.setattr(tokens_module, "sample_rows", sample)
    monkeypatch.setattr(model.llama.steps, "overlap", ahead)
    rng = random.Random(0)
    arrivals = _choices(model, [rng.randrange(3, 250) for _ in range(70)])
    events: list[list[Event]] = [[] for _ in arrivals]
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=32)
    n = 0
    while n < 4 or engine.waiting or engine.running:
        for i, (when, c) in enumerate(arrivals):
            if when == n:
                c.emit = events[i].append
                engine.submit([c])
        with engine.lock:
            engine._admit()
        engine._step()
        n += 1
    assert engine.pending is None
    assert not unwaited or (pinned and len(waits) > n and all(w.waited == 1 for w in waits)), (len(waits), n)
    return events, engine.stats()


def test_the_engine_ahead_of_the_host_reports_what_it_reports_in_step(model, monkeypatch):
    (before, stats), (after, stats_ahead) = (_serve(model, ahead, monkeypatch) for ahead in (False, True))
    assert after == before
    assert _serve(model, True, monkeypatch, unwaited=True)[0] == before
    ends = [evs[-1] for evs in before]
    assert all(len(evs) == 1 for evs in before[5:7])  # the prompt only; one token
    assert [e.finish_reason for e in ends].count("stop") >= 2 and ends[4].error and ends[10].error, ends
    assert sum(e.error is not None for e in ends) == 2 and len(before[10]) == 3  # two tokens, then its error
    assert ends[5].prompt_logprobs and before[9][0].prompt_logprobs and before[1][0].top
    # Ahead, a sequence that a stop rule or a failure ends at a decode pass has run one row more, unread.
    assert stats_ahead["decode_tokens"] > stats["decode_tokens"]
    assert {k: v for k, v in stats_ahead.items() if k != "decode_tokens"} == \
        {k: v for k, v in stats.items() if k != "decode_tokens"}


@pytest.mark.parametrize("ahead, order", [(True, ["run", "run", "read", "run", "read", "run", "read", "read"]),
                                          (False, ["run", "read"] * 4)])
def test_ahead_of_the_host_each_pass_is_read_once_the_next_is_launched(model, monkeypatch, ahead, order):
    """A request of 4 tokens: its prompt's pass, then 3 decode passes, the last known to be the last by its
    length (no fifth pass). Ahead, pass t's tokens are read after pass t + 1 is launched; in step, before."""
    seen, record, run_step = [], tokens_module.Chosen.record, model.llama.run_step
    monkeypatch.setattr(tokens_module.Chosen, "record",
                        lambda self, *a, **k: seen.append("read") or record(self, *a, **k))
    monkeypatch.setattr(model.llama, "run_step", lambda *a: seen.append("run") or run_step(*a))
    monkeypatch.setattr(model.llama.steps, "captured", False)  # eager: a replayed graph does not call run_step
    monkeypatch.setattr(model.llama.steps, "overlap", ahead)
    engine = Engine(model.llama, eos_of(model))
    events: list[Event] = []
    engine.submit([Choice([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), events.append)])
    while engine.waiting or engine.running:
        with engine.lock:
            engine._admit()
        engine._step()
    assert seen == order and len(events) == 4 and events[-1].finish_reason == "length"
