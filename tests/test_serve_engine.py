"""The engine's packing, driven step by step (no HTTP, no engine thread): prompts admitted together share
the tokens they have in common past their whole prefix blocks (one partial block, computed once), and a
pass's prompt tokens run on to the end of its last row tile. Each answer stays its solo run's, bit for bit.

Negative controls: with the engine before these changes, the shared tail is computed once per prompt (the
prefill count is larger), the long prompt needs a second pass for its last tokens, and the prefix cache
has no `acquire_all`."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from minillama import proofs
from minillama.generate import SamplingParams, generate
from minillama.serve.engine import Choice, Engine, Event
from minillama.serve.identity import eos_of
from minillama.serve.prefix import PrefixCache, common_length
from _serve_harness import ckpt, model  # noqa: F401 (fixtures)

PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _run(engine: Engine, prompts: list[list[int]], steps: int | None = None) -> list[list[Event]]:
    """Submit `prompts`, then step the engine on this thread (all of it, or `steps` passes)."""
    events: list[list[Event]] = [[] for _ in prompts]
    engine.submit([Choice(p, PARAMS, events[i].append) for i, p in enumerate(prompts)])
    n = 0
    while (engine.waiting or engine.running) and (steps is None or n < steps):
        with engine.lock:
            engine._admit()
        engine._step()
        n += 1
    return events


def _check_solo(model, prompts: list[list[int]], events: list[list[Event]]) -> None:
    for p, evs in zip(prompts, events):
        solo = generate(model.llama, [p], PARAMS, mode="independent", eos_ids=eos_of(model))[0]
        assert [e.token for e in evs] == solo.token_ids and [e.logprob for e in evs] == solo.logprobs
        assert evs[-1].finish_reason == "length"


def test_prompts_admitted_together_share_their_partial_block(model):
    rng = random.Random(0)
    doc = [rng.randrange(3, 300) for _ in range(64 + 6)]  # one whole block, then 6 document tokens
    prompts = [doc + [first] + [rng.randrange(3, 300) for _ in range(4)] for first in (10, 11, 12)]
    engine = Engine(model.llama, eos_of(model))
    events = _run(engine, prompts)
    _check_solo(model, prompts, events)
    # The block and the 6 document tokens once, then each question's own 5 tokens.
    assert engine.prefill_tokens == 64 + 6 + 3 * 5, engine.stats()
    later = [doc + [13, 20, 21, 22, 23]]  # finds the cached partial block
    events = _run(engine, later)
    _check_solo(model, later, events)
    assert engine.prefill_tokens == 64 + 6 + 4 * 5 and engine.stats()["prefix_hit_tokens"] == 64 + 6, engine.stats()


def test_a_prompt_runs_on_to_the_end_of_the_pass_last_row_tile(model):
    tile = model.llama.tiles.rows
    rng = random.Random(1)
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=tile, prefix_cache=False)
    first = [[rng.randrange(3, 300) for _ in range(5)]]
    running = _run(engine, first, steps=1)  # its prompt, then it decodes one row per pass
    assert len(running[0]) == 1
    fits = model.llama.kernels.tile_end(1 + tile, model.llama.device) - 1  # past max_batch_tokens, to the tile's end
    assert fits > tile
    long = [[rng.randrange(3, 300) for _ in range(fits)]]
    events = _run(engine, long, steps=1)  # 1 decode row + `fits` prompt rows: a whole tile and a short one
    assert len(events[0]) == 1, "the long prompt needed a second pass"
    while engine.running:  # both to the end (their events keep arriving in the same lists)
        engine._step()
    _check_solo(model, long, events)
    _check_solo(model, first, running)


def test_in_buckets_a_prompt_runs_on_to_the_end_of_the_bucket(model, monkeypatch):
    """Where steps are laid out in buckets (captured, on a GPU), a pass computes its bucket's rows whatever it
    holds: prompt tokens fill them (`Llama.rows_end`), past the last row tile's end. The answers stay the solo
    runs'. Negative control: the engine before fills only to the tile's end (a second pass)."""
    monkeypatch.setattr(model.llama.steps, "bucketed", lambda device: True)
    rng = random.Random(2)
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=70, prefix_cache=False)
    first = [[rng.randrange(3, 300) for _ in range(5)]]
    running = _run(engine, first, steps=1)
    fits = model.llama.rows_end(1 + 70) - 1
    assert fits > model.llama.kernels.tile_end(1 + 70, model.llama.device) - 1
    long = [[rng.randrange(3, 300) for _ in range(fits)]]
    events = _run(engine, long, steps=1)  # 1 decode row + `fits` prompt rows: the bucket's every row
    assert len(events[0]) == 1, "the long prompt needed a second pass"
    while engine.running:
        engine._step()
    _check_solo(model, long, events)
    _check_solo(model, first, running)


def test_where_no_short_tile_is_proven_a_prompt_fills_the_whole_tile(model, monkeypatch):
    """`Llama.rows_end` takes a short last tile only where this process's proofs hold it for every weight so far
    (`proofs.held_short`). Where the device proves none (here: proofs whose products of fewer rows nudge the
    last bit, as a GPU whose kernel for fewer rows adds in another order), every pass computes whole tiles,
    and prompt tokens fill the tile a pass computes anyway. The answers stay the solo runs'. Negative control:
    the engine before took every short tile as proven, so its pass ended at the short tile (a second pass)."""
    llama = model.llama
    tile = llama.tiles.rows
    product = proofs._product

    def nudged(r, p, onednn):
        got = product(r, p, onednn)
        return got.nextafter(torch.full_like(got, float("inf"))) if r.shape[0] < tile else got

    monkeypatch.setattr(proofs, "_PROVEN", {})
    monkeypatch.setattr(proofs, "_product", nudged)
    rng = random.Random(3)
    engine = Engine(llama, eos_of(model), max_batch_tokens=4, prefix_cache=False)
    first = [[rng.randrange(3, 300) for _ in range(5)]]
    running = _run(engine, first, steps=1)  # its prompt: every product's proof refuses every short tile
    short = {v for k, v in proofs._PROVEN.items() if k.kind != "long"}  # long: whole tiles at once, not nudged
    assert short and short <= {(), True, False}
    assert llama.kernels.tile_end(1 + 4, llama.device) < tile  # every short tile taken as proven
    assert llama.rows_end(1 + 4) == tile
    long = [[rng.randrange(3, 300) for _ in range(tile - 1)]]
    events = _run(engine, long, steps=1)  # 1 decode row + 63 prompt rows: the whole tile
    assert len(events[0]) == 1, "the long prompt needed a second pass"
    while engine.running:
        engine._step()
    _check_solo(model, long, events)
    _check_solo(model, first, running)


def test_partial_blocks_follow_what_the_prompts_share(model):
    cache = model.llama.new_cache()
    prefix = PrefixCache(cache, block=4)
    a = [0, 1, 2, 3, 4, 5, 6, 7]  # block [0..3], then 4 5 shared with b, then 6 its own (7: the request's)
    b = [0, 1, 2, 3, 4, 5, 9, 9]
    c = [0, 1, 2, 3, 8, 8]  # the same block, then nothing it shares: 8 its own
    d, e = [20, 21, 22, 30], [20, 21, 23, 31]  # another document, no whole block: a partial block at the root
    ca, cb, cc, cd, ce = prefix.acquire_all([a, b, c, d, e])
    assert ca[0] is cb[0] is cc[0] and ca[1] is cb[1] and ca[1].tokens == (4, 5) and ca[1].position == 4
    assert ca[1].refs == 2 and cache.segments[ca[1].segment].parent == ca[0].segment
    assert [x[-1].tokens for x in (ca, cb, cc, cd, ce)] == [(6,), (9,), (8,), (22,), (23,)]
    assert cc[1].position == 4 and ca[2].position == 6 and ca[2].parent is ca[1]
    assert cd[0] is ce[0] and cd[0].tokens == (20, 21) and cd[0].position == 0 and cd[0].parent is None
    for chain in (ca, cb, cc, cd, ce):  # fill them, as the engine would
        for blk in chain:
            if not blk.filled:
                cache.append(torch.full((len(blk.tokens),), blk.segment), torch.arange(blk.position, blk.end))
                blk.filled = len(blk.tokens)
    later = prefix.acquire([0, 1, 2, 3, 4, 5, 1, 2])  # continues past the cached partial block, parts after it
    assert later == ca[:2] and prefix.hits == 4 + 2
    assert prefix.acquire([0, 1, 2, 3, 4, 9]) == ca[:1]  # parts inside a block in use: the whole block only
    for chain in (ca, cb, cc, cd, ce, later, ca[:1]):
        prefix.release(chain)

    # Every block idle: a prompt that parts inside (4, 5) splits it there and shares its head; the tail takes
    # its children, and no token's slot, position or chain changes.
    slots = {blk.segment: cache.chain_slots(blk.segment) for blk in (ca[2], cb[2])}
    split = prefix.acquire([0, 1, 2, 3, 4, 7, 7])
    assert split == [ca[0], ca[1]] and ca[1].tokens == (4,) and ca[1].ready
    tail = ca[1].children[(5,)]
    assert tail.position == 5 and tail.ready and ca[2].parent is tail is cb[2].parent and ca[2].position == 6
    assert cache.segments[tail.segment].parent == ca[1].segment and cache.segments[ca[2].segment].parent == tail.segment
    assert {s: cache.chain_slots(s) for s in slots} == slots
    assert prefix.acquire([0, 1, 2, 3, 4, 5, 6, 1]) == [ca[0], ca[1], tail, ca[2]]  # the old chain, found again


def test_a_lone_prompt_leaves_its_tail_for_the_next_to_share(model):
    """One client at a time: each prompt's tokens past its whole blocks stay cached as a partial block, so
    the next prompt about the same document computes only its question, and one that parts inside the
    document's tail splits that block and shares its head. Each answer is its solo run's, bit for bit.
    (Negative control: before, a lone prompt cached whole blocks only and the next one computed the
    document's last 6 tokens again.)"""
    rng = random.Random(2)
    doc = [rng.randrange(3, 300) for _ in range(64 + 6)]  # one whole block, then 6 document tokens
    engine = Engine(model.llama, eos_of(model))
    total = 0
    for prompt, computed in [(doc + [10, 1, 2, 3, 4], 64 + 6 + 5), (doc + [11, 5, 6, 7, 8], 5),
                             (doc[:67] + [12, 9, 9], 3)]:
        events = _run(engine, [prompt])
        _check_solo(model, [prompt], events)
        total += computed
        assert engine.prefill_tokens == total, (prompt, engine.stats())


def test_a_choices_top_logprobs_do_not_follow_another_choices_k(model):
    """torch.topk picks and orders tied log-probs by the k it is asked for: the engine took one topk of the
    largest k in the pass, so a choice's top log-probs changed when another in its pass asked for more (ties
    are common in bfloat16). Each now takes the k likeliest, ties in token id order, whatever else runs."""
    llama = copy.deepcopy(model.llama)
    with torch.no_grad():  # every token's logit 0 but for tokens 0-2: every top-k list meets ties
        llama.lm_head.weight[3:] = 0
    prompt = [7, 8, 9, 10, 11]

    def tops(*ks: int) -> list[list[list[tuple[int, float]]]]:
        engine = Engine(llama, eos_of(model))
        events: list[list[Event]] = [[] for _ in ks]
        engine.submit([Choice(prompt, PARAMS, events[i].append, top_k=k) for i, k in enumerate(ks)])
        while engine.waiting or engine.running:
            with engine.lock:
                engine._admit()
            engine._step()
        return [[e.top for e in evs] for evs in events]

    alone = tops(5)[0]
    assert tops(5, 20)[0] == alone
    for step in alone:  # the likeliest first, a tie's ids in increasing order
        assert step == sorted(step, key=lambda e: (-e[1], e[0])) and len(step) == 5


def test_top_entries_are_the_k_likeliest_ties_in_id_order_row_by_row():
    """logits.top_entries against its definition (sorted by log-prob, then token id), on bfloat16-rounded rows
    full of ties, with NaN (the least likely) and -inf; a row's entries the same in any group of rows."""
    from minillama.serve.logits import top_entries

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(40, 300, generator=g) * 4).round().log_softmax(-1)  # few distinct values: ties everywhere
    x[3, 5], x[4, :] = float("nan"), float("-inf")
    for k in (1, 5, 20, 300, 301):
        got = top_entries(x, k)
        for r in range(40):
            key = [(-v if v == v else float("inf"), i) for i, v in enumerate(x[r].tolist())]
            want = [i for _, i in sorted(key)][:k]
            assert [i for i, _ in got[r]] == want, (k, r)
            assert top_entries(x[r:r + 1], k)[0] == got[r]


def test_sequences_admitted_together_count_against_the_memory_budget(model):
    """A budget with room for one sequence: of eight submitted together, one runs at a time (before, `_admit`
    compared each with the cache's bytes alone, which those admitted in the same call do not hold yet, and
    all eight ran: 5x the budget)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [[3 + i] + list(range(10, 50)) for i in range(8)]
    engine = Engine(model.llama, eos_of(model), prefix_cache=False)
    engine.budget = engine.kv_per_token * (41 + 40) * 6 // 5
    engine.submit([Choice(p, params, lambda ev: None) for p in prompts])
    peak = 0
    while engine.waiting or engine.running:
        with engine.lock:
            engine._admit()
        assert len(engine.running) <= 1
        engine._step()
        peak = max(peak, engine.cache.used_bytes())
    assert 0 < peak <= engine.budget


@pytest.mark.parametrize("echo", [False, True])
def test_a_burst_sharing_a_document_counts_it_once_only_where_it_is_stored_once(model, echo):
    """Without the prefix cache, or with echo (every row computed), each prompt stores its own copy of the
    document: the budget that holds the document once and eight questions' own tokens holds fewer than eight
    of these at a time, and the cache stays within it (before, all eight were admitted at 2.9x the budget)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    doc = list(range(10, 130))
    engine = Engine(model.llama, eos_of(model), prefix_cache=echo)
    engine.budget = engine.kv_per_token * (len(doc) + 8 * (1 + 40))
    engine.submit([Choice(doc + [3 + i], params, lambda ev: None, echo=echo) for i in range(8)])
    peak = 0
    while engine.waiting or engine.running:
        with engine.lock:
            engine._admit()
        assert len(engine.running) < 8
        engine._step()
        peak = max(peak, engine.cache.used_bytes())
    assert 0 < peak <= engine.budget


def test_a_running_answer_keeps_its_room_in_the_memory_budget(model):
    """A sequence admitted while another runs counts what the running one will still add (its answer up to its
    max_new_tokens), not only the bytes it holds now: with room for one and a half sequences, the second waits
    until the first ends (before, `_admit` saw the first's two tokens, admitted the second, and the two
    answers grew to 1.3x the budget)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = Engine(model.llama, eos_of(model), prefix_cache=False)
    engine.budget = engine.kv_per_token * (2 + 40) * 3 // 2
    engine.submit([Choice([3, 11], params, lambda ev: None)])
    peak = steps = 0
    while steps < 2 or engine.running or engine.waiting:
        if steps == 2:
            engine.submit([Choice([4, 12], params, lambda ev: None)])
        with engine.lock:
            engine._admit()
        assert len(engine.running) <= 1
        engine._step()
        peak, steps = max(peak, engine.cache.used_bytes()), steps + 1
    assert 80 <= steps <= 90 and 0 < peak <= engine.budget


def test_a_burst_sharing_a_document_counts_the_document_once(model):
    """Those admitted together share the tokens their prompts share (`PrefixCache.acquire_all`): a budget with
    room for the document once and each question's own tokens and answer takes all eight in one step, and
    holds them (counting the document eight times would have admitted half of them)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    doc = list(range(10, 50))
    engine = Engine(model.llama, eos_of(model))
    engine.budget = engine.kv_per_token * (len(doc) + 8 * (1 + 40))
    engine.submit([Choice(doc + [3 + i], params, lambda ev: None) for i in range(8)])
    with engine.lock:
        engine._admit()
    assert len(engine.running) == 8 and not engine.waiting
    peak = 0
    while engine.running:
        engine._step()
        peak = max(peak, engine.cache.used_bytes())
    assert 0 < peak <= engine.budget


def _peak_in_passes(engine: Engine) -> list[int]:
    """The cache's largest bytes inside any pass so far (after its tokens got slots, before `_step` evicts)."""
    peak, append = [0], engine.cache.append

    def counted(segments, positions):
        out = append(segments, positions)
        peak[0] = max(peak[0], engine.cache.used_bytes())
        return out

    engine.cache.append = counted
    return peak


def test_a_request_admitted_alone_makes_room_among_idle_cached_blocks(model):
    """With nothing running, a request is admitted whatever its size, but the blocks earlier prompts left cached
    still count: they are evicted before its pass (before, its prompt was computed beside them, 1.8x the budget,
    and they were evicted only after the pass)."""
    rng = random.Random(5)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine = Engine(model.llama, eos_of(model))
    engine.budget = engine.kv_per_token * 100
    peak = _peak_in_passes(engine)
    for prompt in ([rng.randrange(3, 300) for _ in range(90)] for _ in range(2)):
        events: list[Event] = []
        engine.submit([Choice(prompt, params, events.append)])
        while engine.waiting or engine.running:
            with engine.lock:
                engine._admit()
            engine._step()
        solo = generate(model.llama, [prompt], params, mode="independent", eos_ids=eos_of(model))[0]
        assert [e.token for e in events] == solo.token_ids and [e.logprob for e in events] == solo.logprobs
    assert engine.stats()["evicted_blocks"] > 0 and 0 < peak[0] <= engine.budget


def _bursts() -> dict[str, tuple[list[list[int]], int, int]]:
    """(prompts, max_new_tokens, copies of each) admitted together that share less than their common prefixes."""
    rng = random.Random(6)
    doc = [rng.randrange(3, 300) for _ in range(200)]
    d = doc[:40]
    return {"a whole block holds the other's partial tail": ([doc[:100], doc[:100] + doc[100:200]], 2, 1),
            "a later prompt shortens the shared partial block": (
                [d + [11, 12, 13, 14, 15, 16, 17, 18, 50], d + [11, 12, 13, 14, 15, 16, 17, 19, 51], d + [11, 99, 52]],
                2, 1),
            "copies of a prompt hold their last token each": ([doc[:30]], 0, 3)}


@pytest.mark.parametrize("case", sorted(_bursts()))
def test_a_burst_counts_only_what_the_prefix_cache_stores_once(model, case):
    """Prompts admitted together count once only the tokens `PrefixCache.acquire_all` stores once: not a
    partial tail that the other holds in a whole block, not what a later prompt of the group parts from, not
    each copy's last token. With the budget the common prefixes fill (before, all were admitted at once and
    the cache passed it: 238, 62 and 32 tokens of 204, 59 and 30), fewer run together, within it, and every
    answer is its solo run's."""
    prompts, max_new, copies = _bursts()[case]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    engine = Engine(model.llama, eos_of(model))
    together = len(prompts[0]) + sum(len(p) - common_length(p, q) for p, q in zip(prompts[1:], prompts))
    engine.budget = engine.kv_per_token * (together + len(prompts) * max_new)
    peak = _peak_in_passes(engine)
    events: list[list[Event]] = [[] for _ in range(len(prompts) * copies)]
    engine.submit([Choice(p, params, events[k * copies + i].append, index=i)
                   for k, p in enumerate(prompts) for i in range(copies)])
    while engine.waiting or engine.running:
        with engine.lock:
            engine._admit()
        engine._step()
    assert 0 < peak[0] <= engine.budget
    for k, p in enumerate(prompts):
        alone = generate(model.llama, [p] * copies, params, mode="independent", eos_ids=eos_of(model))
        for i, solo in enumerate(alone):
            evs = events[k * copies + i]
            got = [(e.token, e.logprob) for e in evs if e.token is not None]
            assert got == list(zip(solo.token_ids, solo.logprobs))
            assert evs[-1].finish_reason == "length"


def test_stored_counts_the_tokens_acquire_all_stores(model):
    """`prefix.stored`, the admission's count, against the blocks `PrefixCache.acquire_all` makes: random
    prompts over a 3-token alphabet (they share, part and repeat everywhere), at block sizes 4, 8 and 64."""
    from minillama.serve.prefix import stored

    rng = random.Random(7)
    for _ in range(300):
        prefix = PrefixCache(model.llama.new_cache(), block=rng.choice([4, 8, 64]))
        doc = [rng.randrange(3, 6) for _ in range(150)]
        prompts = [doc[:rng.randint(0, 150)] + [rng.randrange(3, 6) for _ in range(rng.randint(1, 5))]
                   for _ in range(rng.randint(1, 6))]
        blocks = {id(b): len(b.tokens) for chain in prefix.acquire_all(prompts) for b in chain}
        assert stored(prompts, prefix.block) == sum(blocks.values()) + len(prompts), prompts


def test_an_admission_counts_the_burst_once_per_request(model, monkeypatch):
    """Each request admitted costs one `prefix.stored` over the burst: the figure without it is the one the
    request before it was admitted with, carried over (before, two: with it and without it)."""
    from minillama.serve import budget

    calls, counted = [0], budget.stored

    def stored(prompts):
        calls[0] += 1
        return counted(prompts)

    monkeypatch.setattr(budget, "stored", stored)
    doc = list(range(10, 100))
    engine = Engine(model.llama, eos_of(model))
    engine.budget = engine.kv_per_token * 10_000
    engine.submit([Choice(doc + [3 + i], PARAMS, lambda ev: None) for i in range(8)])
    with engine.lock:
        engine._admit()
    assert len(engine.running) == 8 and calls[0] == 8


@pytest.mark.parametrize("when", ["together", "mid-prefill"])
def test_an_answer_reserves_each_token_but_the_last(model, when):
    """An answer of max_tokens stores every token but its last, which is never fed back: with a budget of exactly
    what two sequences store (prompt, and answer but one), the second is admitted beside the first, submitted
    together (computed in one pass, in step: the cache reaches the budget) or while the first's prompt is still
    computed, and the cache never passes it (before, each answer counted a token more and the second waited)."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [[3] + list(range(10, 210)), [4] + list(range(10, 210))]
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=64 if when == "mid-prefill" else 512,
                    prefix_cache=False)
    engine.budget = engine.kv_per_token * 2 * (len(prompts[0]) + params.max_new_tokens - 1)
    peak = _peak_in_passes(engine)
    first = Choice(prompts[0], params, lambda ev: None)
    engine.submit([first] if when == "mid-prefill" else [first, Choice(prompts[1], params, lambda ev: None)])
    if when == "mid-prefill":
        with engine.lock:
            engine._admit()
        engine._step()
        assert 0 < first.fed < len(first.tail) and not first.q.answer.token_ids
        engine.submit([Choice(prompts[1], params, lambda ev: None)])
    with engine.lock:
        engine._admit()
    assert len(engine.running) == 2 and not engine.waiting
    while engine.running:
        engine._step()
    assert peak[0] == engine.budget if when == "together" else 0 < peak[0] <= engine.budget


def test_a_mostly_cached_prompt_counts_only_what_it_adds(model):
    """A prompt whose whole blocks the cache holds (here a running request's document) reserves only what it adds:
    its own tokens and answer. With a budget of exactly that beside the running one, it is admitted at once and
    the cache stays within the budget (before, its document counted again and it waited for the first to end)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    doc = list(range(10, 138))  # two whole blocks
    first, later = doc + [3, 5, 6, 7, 8], doc + [4, 5, 6, 7, 8]
    engine = Engine(model.llama, eos_of(model))
    engine.budget = engine.kv_per_token * (len(first) + len(later) - len(doc) + 2 * (params.max_new_tokens - 1))
    peak = _peak_in_passes(engine)
    events: list[list[Event]] = [[], []]
    engine.submit([Choice(first, params, events[0].append)])
    with engine.lock:
        engine._admit()
    engine._step()
    engine.submit([Choice(later, params, events[1].append)])
    with engine.lock:
        engine._admit()
    assert len(engine.running) == 2 and not engine.waiting
    while engine.running:
        engine._step()
    assert 0 < peak[0] <= engine.budget and engine.stats()["prefix_hit_tokens"] == len(doc)
    for p, evs in zip((first, later), events):
        solo = generate(model.llama, [p], params, mode="independent", eos_ids=eos_of(model))[0]
        assert [e.token for e in evs] == solo.token_ids and [e.logprob for e in evs] == solo.logprobs


def test_a_burst_counts_at_least_what_it_adds_to_a_cache_that_holds_blocks(model):
    """`Reservation`'s count for prompts admitted together (`prefix.stored` less the whole blocks found,
    `PrefixCache.found`) is never less than what `acquire_all` then adds: tokens of new blocks, of idle blocks
    not computed yet, each prompt's last (a block some running request holds is in its own reservation). Random
    trees over a 3-token alphabet: bursts before, their blocks computed wholly, partly or not at all, then
    finished or still running."""
    from minillama.serve.prefix import stored

    rng = random.Random(8)
    credited = 0
    for _ in range(300):
        prefix = PrefixCache(model.llama.new_cache(), block=rng.choice([4, 8, 64]))
        doc = [rng.randrange(3, 6) for _ in range(150)]

        def burst() -> list[list[int]]:
            return [doc[:rng.randint(0, 150)] + [rng.randrange(3, 6) for _ in range(rng.randint(1, 5))]
                    for _ in range(rng.randint(1, 6))]

        for _ in range(rng.randint(0, 3)):
            for chain in prefix.acquire_all(burst()):
                computed = rng.randint(0, sum(len(b.tokens) for b in chain))  # in chain order, as the engine fills
                for b in chain:
                    n = max(0, min(len(b.tokens) - b.filled, computed - b.filled))
                    at = b.position + b.filled
                    prefix.cache.append(torch.full((n,), b.segment), torch.arange(at, at + n))
                    b.filled, computed = b.filled + n, computed - len(b.tokens)
                if rng.random() < 0.6:
                    prefix.release(chain)
            prefix.evict(max(1, int(prefix.cache.used_bytes() * rng.random())))
        prompts = burst()
        before = {id(b): b.refs for b in prefix.blocks.values()}
        counted = stored(prompts, prefix.block) - prefix.found(prompts)
        credited += counted < stored(prompts, prefix.block)
        chains = prefix.acquire_all(prompts)
        added = {id(b): 0 if before.get(id(b)) else len(b.tokens) - b.filled for chain in chains for b in chain}
        assert sum(added.values()) + len(prompts) <= counted, prompts
    assert credited > 100


@pytest.mark.parametrize("seed", range(3))
def test_the_budget_holds_where_cached_blocks_are_counted_as_found(model, seed):
    """Random requests over two documents (whole blocks found cached, held, or evicted to make room while a burst
    is admitted), some cancelled with their prompt partly computed (idle blocks left partly computed), arriving
    while others run, with a budget that fits the largest alone: after each admission that checked the budget,
    the cache and all that the running sequences may still store (`budget.planned`, exact for answers without
    EOS) fit it, and in every pass the cache holds at most the budget."""
    from minillama.serve.budget import planned

    rng = random.Random(seed)
    docs = [[rng.randrange(3, 300) for _ in range(150)] for _ in range(2)]
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=16)
    prompts = [rng.choice(docs)[:rng.choice([64, 100, 130, 150])] + [rng.randrange(3, 300) for _ in range(3)]
               for _ in range(24)]
    params = [SamplingParams(max_new_tokens=rng.randint(0, 4), ignore_eos=True) for _ in prompts]
    largest = max(len(p) + max(sp.max_new_tokens - 1, 0) for p, sp in zip(prompts, params))
    engine.budget = engine.kv_per_token * rng.randint(largest, largest * 3 // 2)
    peak = _peak_in_passes(engine)
    waiting = [Choice(p, sp, lambda ev: None) for p, sp in zip(prompts, params)]
    checked = 0
    while waiting or engine.waiting or engine.running:
        if waiting and rng.random() < 0.5:
            engine.submit([waiting.pop() for _ in range(min(len(waiting), rng.randint(1, 4)))])
        for s in engine.running:
            if 0 < s.fed < len(s.tail) and rng.random() < 0.3:
                engine.cancel([s])
        before = len(engine.running)
        with engine.lock:
            engine._admit()
        if before or len(engine.running) > 1:
            checked += len(engine.running) > before
            assert engine.cache.used_bytes() + planned(engine.running, engine.kv_per_token) <= engine.budget
        engine._step()
        assert peak[0] <= engine.budget
    assert checked and engine.stats()["prefix_hit_tokens"] > 0 and engine.stats()["evicted_blocks"] > 0


def _burst_at_the_budget(engine: Engine, model, burst: list[list[int]], admitted: int,
                         echo_last: bool = False) -> dict[str, int]:
    """Submit `burst` (answers of 2 tokens: each stores one; `echo_last`: the last with echo) in one admission: the
    first `admitted` of them run, the rest wait; stepped to the end, the cache reaches the budget in a pass and never
    passes it, and the first prompt's answer is its solo run's. Returns the engine's stats right after that
    admission."""
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    peak = _peak_in_passes(engine)
    events: list[list[Event]] = [[] for _ in burst]
    engine.submit([Choice(p, params, events[i].append, echo=echo_last and i == len(burst) - 1)
                   for i, p in enumerate(burst)])
    with engine.lock:
        engine._admit()
    assert [s.prompt for s in engine.running] == burst[:admitted], "over the budget, a later prompt was admitted"
    stats = engine.stats()
    while engine.waiting or engine.running:
        engine._step()
        with engine.lock:
            engine._admit()
    assert peak[0] == engine.budget, (peak[0] // engine.kv_per_token, engine.budget // engine.kv_per_token)  # tokens
    solo = generate(model.llama, burst[:1], params, mode="independent", eos_ids=eos_of(model))[0]
    assert [e.token for e in events[0]] == solo.token_ids and [e.logprob for e in events[0]] == solo.logprobs
    return stats


def test_an_idle_block_partly_computed_is_found_for_the_tokens_it_holds(model):
    """A prompt cancelled partway leaves its first block idle with 16 of its 64 tokens computed; a burst's first
    prompt continues past it and computes the other 48. `PrefixCache.found` credits the 16 the cache holds, not
    the block: with a budget of the cache's 16 tokens and exactly what the first two prompts add (the block's other
    48 among them), those two run together and the cache reaches the budget, and the third, of 20 tokens, waits. Negative control:
    crediting the idle block's 64 tokens admits the third beside them, and the cache passes the budget by its 21."""
    rng = random.Random(9)
    doc = [rng.randrange(3, 300) for _ in range(64)]
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=16)
    cancelled = Choice(doc + [1, 2], PARAMS, lambda ev: None)
    engine.submit([cancelled])
    with engine.lock:
        engine._admit()
    engine._step()  # 16 of the block's tokens
    block = cancelled.blocks[0]
    engine.cancel([cancelled])
    engine._step()
    assert block.refs == 0 and block.filled == 16 and engine.cache.used_bytes() == engine.kv_per_token * 16
    engine.max_batch_tokens = 512  # the burst's prompts in one pass, its answers in the next: all stored at once
    first, second = doc + [5, 6], list(range(200, 210))
    # the cache's 16 tokens, the block's other 48, the first's tail and last token, the second's 10, an answer each
    engine.budget = engine.kv_per_token * (16 + 48 + 2 + 10 + 2)
    _burst_at_the_budget(engine, model, [first, second, list(range(220, 240))], admitted=2)


def test_a_burst_counts_again_a_found_block_evicted_to_admit_an_echo_request(model):
    """A document's block left idle and computed by a finished prompt; the burst's first prompt finds it (counts
    only its tail, last token and answer). Admitting the third, an echo request (its own prompt, no prefix cache),
    the engine evicts the idle blocks, the found one with them: the burst is counted again (`Reservation.recount`)
    with the block to compute, and with a budget of exactly what the first two store, those two run together, the
    cache reaches the budget, and the third waits. (A request that shares the prefix cache counts the burst again in
    its own `need`; an echo request's counts its prompt alone, so only the recount sees the block gone.) Negative
    control: without the recount the eviction seems to free the block's 64 tokens, the echo request is admitted,
    and the cache passes the budget by its 6."""
    rng = random.Random(10)
    doc = [rng.randrange(3, 300) for _ in range(64)]
    engine = Engine(model.llama, eos_of(model))
    _run(engine, [doc + [1, 2]])  # the block, then a partial block of 1, idle
    assert engine.cache.used_bytes() == engine.kv_per_token * 65
    first, second = doc + [5, 6], list(range(200, 210))
    # the block, the first's tail and last token, the second's 10, an answer token each
    engine.budget = engine.kv_per_token * (64 + 2 + 10 + 2)
    admitted = _burst_at_the_budget(engine, model, [first, second, list(range(220, 225))], admitted=2, echo_last=True)
    assert admitted["evicted_blocks"] == 2 and engine.stats()["prefix_hit_tokens"] == 0  # the found block went


def test_the_kernels_cannot_change_while_the_engine_serves(model):
    """While the engine's loop runs, `model.invariant` and `.units` refuse to change (RuntimeError), as under a
    generate call, so no answer or cached block mixes two kinds of kernels; the answer being served keeps its solo
    bits, and once the loop has stopped the switches are free (before, the flip went through mid-answer)."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = list(range(10, 80))
    events: list[Event] = []
    engine = Engine(model.llama, eos_of(model)).start()
    try:
        first = threading.Event()
        engine.submit([Choice(prompt, params, lambda ev: (events.append(ev), first.set()))])
        assert first.wait(60)
        with pytest.raises(RuntimeError, match="model.invariant cannot change while generate"):
            model.llama.invariant = False
        with pytest.raises(RuntimeError, match="model.units cannot change"):
            model.llama.units = model.llama.units
        while not (events and events[-1].finish_reason) and engine.alive:
            time.sleep(0.01)
    finally:
        engine.stop(60)
        model.llama.invariant = True  # stopped: free again (and the model as it was, whatever happened above)
    solo = generate(model.llama, [prompt], params, mode="independent", eos_ids=eos_of(model))[0]
    assert [e.token for e in events] == solo.token_ids and [e.logprob for e in events] == solo.logprobs


def test_an_echoed_prompt_is_reduced_pass_by_pass_not_held_as_vocabulary_rows(model):
    """Echo kept every prompt row's log-softmax (a vocabulary of floats per prompt token: SmolLM2's 196 KB,
    4x its KV) until the prompt was done, outside the memory budget. Each pass's rows are reduced as they
    come: the choice holds no tensor between passes, and its prompt log-probs, ranks and top-k are those of
    the whole prompt's rows in one pass."""
    from minillama.serve.logits import prompt_row_entries

    rng = random.Random(3)
    prompt = [rng.randrange(3, 300) for _ in range(150)]
    engine = Engine(model.llama, eos_of(model), max_batch_tokens=40, prefix_cache=False)
    events: list[Event] = []
    choice = Choice(prompt, PARAMS, events.append, echo=True, prompt_top_k=3)
    engine.submit([choice])
    passes = 0
    while engine.waiting or engine.running:
        with engine.lock:
            engine._admit()
        engine._step()
        passes += 1
        held = [k for k, v in vars(choice).items()
                if isinstance(v, torch.Tensor) or (isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v))]
        assert not held, (passes, held)
    assert passes > 4  # the prompt took several passes
    with torch.no_grad():
        whole = prompt_row_entries(torch.log_softmax(model.llama(torch.tensor(prompt)).float(), -1), prompt, 0, 3)
    assert events[0].prompt_logprobs == [(None, None, []), *whole]
    _check_solo(model, [prompt], [events])
