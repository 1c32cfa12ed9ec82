"""The blocked kernel: the segment rule's attention, equal to the bit to the one-row reference, and shared.

Every test builds a cache with a document, questions under it and unrelated roots, gives the new tokens
slots (`KVCache.append`), plans the pass and fills the cache with random keys and values.
"""

import dataclasses

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import minillama.batched as batched
import minillama.plan as plan_module
from minillama.attention import blocked_attention, masked_attention, reference_attention, segment_attention
from minillama.batched import proven_batches, proven_rows
from minillama.audit import Launches
from minillama.blocks import CPU_ATTENTION, KEY_BLOCK, AttentionTiles, ItemTiles, first_visible, visible_blocks
from minillama.cache import PAD_SLOT, KVCache
from minillama.invariant import CPU_TILES, Tiles, last_tile
from minillama.plan import plan_attention
from tiny import DEVICE, ON_CPU, SMALL_TILES, tiny_config

TILES = st.sampled_from([SMALL_TILES, CPU_TILES, Tiles(rows=8, attention=AttentionTiles(
    whole=ItemTiles(rows=8, batch=2, chunk=2), partial=ItemTiles(rows=8, batch=2, chunk=4))), *ON_CPU])


def chunks(tiles, whole, partial, **kw):
    """`tiles` with each kind's chunk changed (its rows and batch kept)."""
    return dataclasses.replace(tiles, whole=dataclasses.replace(tiles.whole, chunk=whole),
                               partial=dataclasses.replace(tiles.partial, chunk=partial), **kw)


# CPU_ATTENTION's products, one batch per chunk and nothing kept whole: every pass past one batch is chunked.
CHUNKED = chunks(CPU_ATTENTION, CPU_ATTENTION.whole.batch, CPU_ATTENTION.partial.batch, keep=0, hold=0)
# Sliding windows (Mistral's rule): none, inside one block, at and around a block's size, several blocks.
WINDOWS = st.sampled_from([None, None, 1, 7, 63, 64, 65, 130])


def layout(config, doc, qs, others, dtype=torch.float32, decode=False):
    """A cache holding a document (root), questions (its children) and unrelated roots.

    Returns (cache, segments, positions) of the pass: every token, or with `decode` one more token each.
    """
    cache = KVCache(config, device=DEVICE, dtype=dtype)
    pieces = ([(None, doc)] if doc else []) + [(0 if doc else None, n) for n in qs] + [(None, n) for n in others]
    sids, segs, poss = [], [], []
    for parent, length in pieces:
        sid = cache.new_segment(None if parent is None else sids[parent])
        start = doc if parent is not None else 0
        sids.append(sid)
        segs += [sid] * length
        poss += range(start, start + length)
    segs, poss = torch.tensor(segs), torch.tensor(poss)
    if decode:  # everything so far is in the cache; the pass is one more token of each question
        cache.append(segs, poss)
        q_sids = sids[1:] if doc else sids
        segs = torch.tensor(q_sids)
        poss = torch.tensor([cache.length(s) for s in q_sids])
    cache.append(segs, poss)
    return cache, segs, poss


def fill(cache, n_rows, g, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hkv, d = cache.k.shape[1], cache.k.shape[3]
    cache.k[0] = torch.randn(cache.k[0].shape, generator=gen).to(DEVICE, dtype)
    cache.v[0] = torch.randn(cache.v[0].shape, generator=gen).to(DEVICE, dtype)
    cache.k[0][:, PAD_SLOT] = cache.v[0][:, PAD_SLOT] = 0
    return torch.randn(hkv, n_rows * g, d, generator=gen).to(DEVICE, dtype)


@settings(max_examples=40, deadline=None)
@given(doc=st.integers(0, 200), qs=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       others=st.lists(st.integers(1, 90), max_size=2), g=st.sampled_from([1, 3]), seed=st.integers(0, 99),
       tiles=TILES, window=WINDOWS)
def test_blocked_equals_dense_float64_reference(doc, qs, others, g, seed, tiles, window):
    config = tiny_config(heads=2 * g, kv_heads=2, head_dim=8)
    cache, segs, poss = layout(config, doc, qs, others, torch.float64)
    n = len(segs)
    plan = plan_attention(cache, segs, poss, g, n_rows=n, tiles=tiles.attention, dense=True, window=window)
    q = fill(cache, n, g, seed, torch.float64)
    got = blocked_attention(q, cache.k[0], cache.v[0], plan, tiles.attention)

    # The rule: per token, one softmax over exactly the keys the segment rule (and window) allow, in float64.
    for t in range(n):
        sid, p = int(segs[t]), int(poss[t])
        chain = cache.chain_slots(sid)  # the whole chain: the token's later ones are past p, hidden
        assert plan.visible[t].nonzero().flatten().tolist() == sorted(chain[first_visible(p, window):p + 1])
        rows = slice(t * g, t * g + g)  # the token's G query rows
        want = segment_attention(q[:, rows], cache.k[0], cache.v[0], chain, p, window)
        torch.testing.assert_close(got[:, rows], want, atol=1e-12, rtol=1e-12)
        if t == 0:  # one row alone gives that row
            one = segment_attention(q[:, :1], cache.k[0], cache.v[0], chain, p, window)
            torch.testing.assert_close(got[:, :1], one, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(masked_attention(q, cache.k[0], cache.v[0], plan), got, atol=1e-12, rtol=1e-12)
    for items in (plan.whole, plan.partial):  # every item holds rows of tokens whose chains hold its keys
        for i in range(items.count):
            item = items.item(i)
            for token in set(item.rows[:, 1].tolist()):
                chain, p = cache.chain_slots(int(segs[token])), int(poss[token])
                assert item.slots.tolist() == [chain[x] for x in item.positions.tolist()]
                if items is plan.whole:
                    assert first_visible(p, window) <= item.positions.min() and item.positions.max() <= p


@settings(max_examples=30, deadline=None)
@given(doc=st.integers(0, 140), qs=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       others=st.lists(st.integers(1, 70), max_size=1), g=st.sampled_from([1, 2]), seed=st.integers(0, 99),
       tiles=TILES, decode=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), window=WINDOWS)
def test_fast_kernel_equals_the_one_row_reference_to_the_bit(doc, qs, others, g, seed, tiles, decode, dtype, window):
    """`blocked_attention` batches what `reference_attention` does one row and one block at a time."""
    config = tiny_config(heads=2 * g, kv_heads=2, head_dim=8)
    cache, segs, poss = layout(config, doc, qs, others, dtype, decode)
    n = len(segs)
    rows = -(-n // tiles.rows) * tiles.rows  # padded as the model pads
    plan = plan_attention(cache, segs, poss, g, n_rows=rows, tiles=tiles.attention, window=window)
    q = fill(cache, rows, g, seed, dtype)
    fast = blocked_attention(q, cache.k[0], cache.v[0], plan, tiles.attention)[:, :n * g]
    slow = reference_attention(q[:, :n * g], cache.k[0], cache.v[0], poss.tolist(),
                               [cache.chain_slots(int(s))[:int(p) + 1] for s, p in zip(segs, poss)], tiles.attention, window)
    assert torch.equal(fast, slow)


def test_a_chunked_pass_gives_the_same_bits_as_one_chunk():
    """Past `ItemTiles.chunk` items, scores are computed twice instead of held: not a bit changes."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=16)
    cache, segs, poss = layout(config, 300, [20, 45, 7], [90])
    # The same products (CPU_ATTENTION's batch counts) in one chunk and in chunks of one batch.
    big = chunks(CHUNKED, 1 << 20, 1 << 20)
    small = CHUNKED
    rows = -(-len(segs) // 64) * 64
    plan = plan_attention(cache, segs, poss, 3, n_rows=rows, tiles=big)
    assert plan.whole.count > small.whole.chunk and plan.partial.count > small.partial.chunk  # really chunked
    q = fill(cache, rows, 3, 0)
    assert torch.equal(blocked_attention(q, cache.k[0], cache.v[0], plan, big),
                       blocked_attention(q, cache.k[0], cache.v[0], plan, small))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="torch's fused attention kernel is a CPU's")
def test_fused_items_run_torchs_cpu_kernel_and_keep_every_bit():
    """`AttentionTiles.fused`: every item's softmax is one call of torch's fused CPU kernel and no `bmm`
    remains; the pass equals its one-row reference, in chunks as in one, row order as block order. Its bits
    are its own (another arithmetic than the `bmm` path's), close to them."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=16)
    cache, segs, poss = layout(config, 300, [20, 45, 7], [90])
    fused = dataclasses.replace(CHUNKED, fused=True)
    rows = -(-len(segs) // 64) * 64
    plan = plan_attention(cache, segs, poss, 3, n_rows=rows, tiles=chunks(fused, 1 << 20, 1 << 20))
    assert plan.order is not None and plan.whole.count > fused.whole.chunk  # held at once, or really chunked
    q = fill(cache, rows, 3, 0)
    outs = {}
    for name, tiles in (("one chunk", chunks(fused, 1 << 20, 1 << 20)), ("chunked", fused)):
        for order in (plan.order, None):  # row order (a decode step's), block order
            plan.order = order
            with Launches() as seen:
                outs[name, order is None] = blocked_attention(q, cache.k[0], cache.v[0], plan, tiles)
            assert seen.counts["aten._scaled_dot_product_flash_attention_for_cpu.default"] > 0
            assert "aten.bmm.out" not in seen.counts and "aten.sum.IntList_out" not in seen.counts
    first = outs["one chunk", False]
    assert all(torch.equal(out, first) for out in outs.values())
    n = len(segs)
    slow = reference_attention(q[:, :n * 3], cache.k[0], cache.v[0], poss.tolist(),
                               [cache.chain_slots(int(s))[:int(p) + 1] for s, p in zip(segs, poss)], fused)
    assert torch.equal(first[:, :n * 3], slow)
    separate = blocked_attention(q, cache.k[0], cache.v[0], plan, CHUNKED)
    assert not torch.equal(first, separate)
    torch.testing.assert_close(first, separate)


def _bmm_calls(count: int, kind, keep: int, hold: int) -> int:
    """`bmm` calls a kind's items take: scores and values once for a chunk whose scores are held, else the
    scores twice (the maxima, then the values)."""
    chunk = count if 0 < count <= keep else kind.chunk
    bounds = [(lo, min(lo + chunk, count)) for lo in range(0, count, chunk)]
    return sum(-(-(hi - lo) // kind.batch) * (2 if hi <= max(chunk, hold) else 3) for lo, hi in bounds)


def test_a_pass_within_keep_holds_its_scores_in_one_chunk_and_past_it_holds_chunks_up_to_hold():
    """`AttentionTiles.keep`: a kind with at most that many items runs as one chunk (no scores computed twice), bits
    unchanged; past it, the chunks of `ItemTiles.chunk` come back, and `AttentionTiles.hold` keeps the first
    chunks' scores from pass 1 to pass 2 (fewer products, the same bits)."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=16)
    cache, segs, poss = layout(config, 300, [20, 45, 7], [90])
    # every item in `bmm` calls of 32-row tiles
    small = dataclasses.replace(CHUNKED, whole=dataclasses.replace(CHUNKED.whole, runs=0, long_rows=()))
    rows = -(-len(segs) // 64) * 64
    plan = plan_attention(cache, segs, poss, 3, n_rows=rows, tiles=small)
    q = fill(cache, rows, 3, 0)
    chunked = blocked_attention(q, cache.k[0], cache.v[0], plan, small)
    kinds = [(plan.whole, small.whole), (plan.partial, small.partial)]
    kinds += [] if plan.small is None else [(plan.small, small.whole)]  # a question's own whole block: 3 rows
    most = max(items.count for items, _ in kinds)
    assert min(-(-items.count // kind.chunk) for items, kind in kinds[:2]) >= 3  # several chunks to hold or not
    counts = {}
    for name, keep, hold in (("chunked", 0, 0), ("kept", most, 0),
                             ("just past", min(plan.whole.count, plan.partial.count) - 1, 0),
                             ("held", 0, most), ("two chunks held", 0, 2 * max(kind.chunk for _, kind in kinds))):
        tiles = dataclasses.replace(small, keep=keep, hold=hold)
        with Launches() as seen:
            out = blocked_attention(q, cache.k[0], cache.v[0], plan, tiles)
        counts[name] = seen.counts.get("aten.bmm.out", 0)
        assert counts[name] == sum(_bmm_calls(items.count, kind, keep, hold) for items, kind in kinds), name
        assert torch.equal(out, chunked), name
    assert counts["chunked"] > counts["two chunks held"] > counts["held"] == counts["kept"]
    assert counts["just past"] == counts["chunked"]


def test_decode_reads_each_document_block_once_per_tile_of_questions():
    """Hydragen: in a decode step of 40 questions, each document block meets tiles of many questions."""
    config = tiny_config(heads=3, kv_heads=1, head_dim=8)
    cache, segs, poss = layout(config, 5 * KEY_BLOCK, [4] * 40, [], decode=True)
    tiles = CPU_ATTENTION
    plan = plan_attention(cache, segs, poss, 3, n_rows=64, tiles=tiles)
    doc_slots = cache.segments[0].slots
    whole = plan.whole
    # 40 questions x 3 heads = 120 rows: the fewest tiles that hold them against each of the 5 blocks (two of
    # 64 rows where proven, ItemTiles.long_rows, else four of 32), padded to a batch, short where proven (the
    # padding joins the last block).
    tile = whole.rows.shape[1]
    assert tile in (tiles.whole.rows, *tiles.whole.long_rows)
    kind = tiles.whole if tile == tiles.whole.rows else dataclasses.replace(tiles.whole, rows=tile, short_rows=(),
                                                                              long_rows=())
    n = -(-120 // tile)
    short = proven_batches(kind, 8, torch.float32, cache.k.device)
    assert n < 40 and 5 * n < tiles.whole.batch and whole.count == last_tile(5 * n, tiles.whole.batch, short)
    assert whole.bounds == [0, n, 2 * n, 3 * n, 4 * n, whole.count]
    for b in range(5):
        for i in range(n * b, n * b + n):
            assert whole.keys[i].tolist() == doc_slots[b * KEY_BLOCK:(b + 1) * KEY_BLOCK]
        rows = whole.rows[n * b:n * b + n].reshape(-1)
        assert set(rows[rows < 120].tolist()) == set(range(120))
    # The block holding each question's own tokens is that question's alone, in a small tile.
    part = plan.partial
    assert part.count == tiles.partial.batch and part.bounds == [0, tiles.partial.batch]  # 40 items, padded
    for w in range(40):
        keys = part.keys[w].tolist()
        assert keys[:5] == cache.segments[w + 1].slots and set(keys[5:]) == {PAD_SLOT}
        assert part.rows[w].tolist()[:3] == [3 * w, 3 * w + 1, 3 * w + 2]
    assert not part.hidden[:40, :3, :5].any() and part.hidden[:40, :3, 5:].all()  # keys 0..4 of block 5 visible


def test_the_rule_notices_a_kernel_that_lets_a_question_see_its_sibling():
    """Negative control for the tolerance check against `segment_attention`: one leaked key fails it."""
    config = tiny_config(heads=2, kv_heads=1, head_dim=8)
    cache, segs, poss = layout(config, 70, [6, 5], [], torch.float64)
    n = len(segs)
    plan = plan_attention(cache, segs, poss, 2, n_rows=n, tiles=SMALL_TILES.attention, dense=True)
    q = fill(cache, n, 2, 0, torch.float64)
    last = n - 1  # the second question's last token
    chain, p = cache.chain_slots(int(segs[last])), int(poss[last])
    want = segment_attention(q[:, 2 * last:], cache.k[0], cache.v[0], chain, p)
    torch.testing.assert_close(masked_attention(q, cache.k[0], cache.v[0], plan)[:, 2 * last:], want,
                               atol=1e-12, rtol=1e-12)
    sibling = cache.segments[int(segs[70])].slots[0]  # the first question's first key
    assert not plan.visible[last, sibling]
    plan.visible[last, sibling] = True
    leaked = masked_attention(q, cache.k[0], cache.v[0], plan)[:, 2 * last:]
    assert (leaked - want).abs().max() > 1e-6


def test_an_item_reads_back_as_heads_tokens_and_positions():
    """`Items.item(i)`: the tile's real rows as (KV head, token, query head) and its block's slots and
    positions, for a decode step of 5 questions on a 150-token document with two KV heads of 3 query heads."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=8)
    cache, segs, poss = layout(config, 150, [4, 1, 7, 2, 3], [], decode=True)
    plan = plan_attention(cache, segs, poss, 3, n_rows=16, tiles=CPU_ATTENTION)
    doc = cache.segments[0].slots
    every_row = [[t, g] for t in range(5) for g in range(3)]
    whole = [plan.whole.item(i) for i in range(plan.whole.count)]
    # Blocks 0 and 1 of the document, each once per KV head, with all 15 query rows of that head.
    assert [(it.block, it.rows[:, 0].unique().tolist()) for it in whole[:4]] == [(0, [0]), (0, [1]), (1, [0]), (1, [1])]
    for it in whole[:4]:
        assert it.rows[:, 1:].tolist() == every_row
        assert it.slots.tolist() == doc[it.block * 64:it.block * 64 + 64]
        assert it.positions.tolist() == list(range(it.block * 64, it.block * 64 + 64))
    assert all(len(it.rows) == len(it.slots) == 0 for it in whole[4:])  # dummy items: nothing real
    # Each question's own block 2 (128 .. 153 + its length): the document's tail, then its own tokens.
    for i in range(10):
        it = plan.partial.item(i)
        head, token = i % 2, i // 2  # per question, KV head 0 then 1
        assert it.block == 2 and it.rows.tolist() == [[head, token, g] for g in range(3)]
        chain = cache.chain_slots(int(segs[token]))
        assert it.positions.tolist() == list(range(128, int(poss[token]) + 1))
        assert it.slots.tolist() == chain[128:int(poss[token]) + 1]


def test_blocks_split_at_owners_and_keep_block_order():
    """A question longer than a block owns that block: its rows see the document's blocks, then their own."""
    config = tiny_config(heads=2, kv_heads=1, head_dim=8)
    cache = KVCache(config)
    doc = cache.new_segment()
    cache.append(torch.tensor([doc] * 130), torch.arange(130))  # blocks 0, 1 whole; block 2 partly
    long_q, short_q = cache.new_segment(doc), cache.new_segment(doc)
    cache.append(torch.tensor([short_q] * 3), torch.arange(130, 133))
    cache.append(torch.tensor([long_q] * 80), torch.arange(130, 210))  # reaches block 3 (192..255)
    segs, poss = torch.tensor([long_q, short_q]), torch.tensor([210, 133])
    cache.append(segs, poss)
    plan = plan_attention(cache, segs, poss, 2, n_rows=2, tiles=CPU_ATTENTION, dense=True)
    doc_slots, long_slots = cache.segments[doc].slots, cache.segments[long_q].slots
    whole = plan.whole
    seen: dict[int, list[tuple[int, list[int]]]] = {}  # row -> (block, keys) in the order they are added
    for k, (a, b) in enumerate(zip(whole.bounds, whole.bounds[1:])):
        for i in range(a, b):
            for r in whole.rows[i].tolist():
                if r < 4:  # row 4 is the spare row
                    seen.setdefault(r, []).append((i, whole.keys[i].tolist()))
    for r in (0, 1, 2, 3):  # every row: document blocks 0 and 1, in order, keys read from the document
        assert [keys for _, keys in seen[r][:2]] == [doc_slots[:64], doc_slots[64:128]]
    # The long question's rows (token 0) also see block 2 whole: the document's last two slots, then its own.
    assert len(seen[0]) == 3 and seen[0][2][1] == doc_slots[128:] + long_slots[:62]
    assert len(seen[2]) == 2
    q = torch.randn(1, 4, 8)
    cache.k.normal_(), cache.v.normal_()
    cache.k[:, :, PAD_SLOT] = cache.v[:, :, PAD_SLOT] = 0
    torch.testing.assert_close(blocked_attention(q, cache.k[0], cache.v[0], plan, CPU_ATTENTION),
                               masked_attention(q, cache.k[0], cache.v[0], plan))


def test_padding_rows_get_zeros_not_nan():
    config = tiny_config(heads=2, kv_heads=1, head_dim=8)
    cache, segs, poss = layout(config, 0, [5], [])
    plan = plan_attention(cache, segs, poss, 2, n_rows=16, tiles=SMALL_TILES.attention)
    q = fill(cache, 16, 2, 0)
    out = blocked_attention(q, cache.k[0], cache.v[0], plan, SMALL_TILES.attention)
    assert torch.isfinite(out).all() and (out[:, 10:] == 0).all()


@pytest.mark.parametrize("tiles", [SMALL_TILES.attention, *(t.attention for t in ON_CPU)])
def test_the_reference_notices_a_kernel_that_adds_blocks_out_of_order(tiles):
    """Negative control for the bit-equality property: the same terms summed in another order are caught
    (each block's scores in separate passes, or its softmax by the fused kernel)."""
    config = tiny_config(heads=2, kv_heads=2, head_dim=8)
    cache, segs, poss = layout(config, 600, [30], [], decode=True)
    plan = plan_attention(cache, segs, poss, 1, n_rows=16, tiles=tiles)
    q = fill(cache, 16, 1, 3)
    slow = reference_attention(q[:, :1], cache.k[0], cache.v[0], poss.tolist(),
                               [cache.chain_slots(int(segs[0]))[:int(poss[0]) + 1]], tiles)
    assert torch.equal(blocked_attention(q, cache.k[0], cache.v[0], plan, tiles)[:, :1], slow)
    w, n = plan.whole, plan.whole.count
    w.rows, w.keys = w.rows.flip(0), w.keys.flip(0)  # the last block first
    w.bounds = [n - b for b in reversed(w.bounds)]
    fast = blocked_attention(q, cache.k[0], cache.v[0], plan, tiles)[:, :1]
    assert not torch.equal(fast, slow)
    torch.testing.assert_close(fast, slow)


# CPU_ATTENTION without short batches: every kind's items in whole batches.
WHOLE_BATCHES = CPU_TILES.whole_only().attention


def _short_and_whole(config, doc, qs, decode, tiles=CPU_ATTENTION, seed=5):
    """Attention over one pass planned with `tiles` (short last batches where proven) and with whole batches
    only: (short plan, its output, the whole-batch output)."""
    g = config.num_attention_heads // config.num_key_value_heads
    cache, segs, poss = layout(config, doc, qs, [], decode=decode)
    n = -(-len(segs) // 8) * 8
    q = fill(cache, n, g, seed)
    short = plan_attention(cache, segs, poss, g, n_rows=n, tiles=tiles)
    whole = plan_attention(cache, segs, poss, g, n_rows=n, tiles=WHOLE_BATCHES)
    return (short, blocked_attention(q, cache.k[0], cache.v[0], short, tiles),
            blocked_attention(q, cache.k[0], cache.v[0], whole, WHOLE_BATCHES))


@pytest.fixture(params=[1, 2])
def threads(request):
    """torch's thread count for the test, put back after it: a proof holds per thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _nudge_bmm(monkeypatch, when) -> None:
    """`torch.bmm` that moves its result's last bit up where `when(a)`: a library whose calls of that shape add
    in another order. Every proof starts over."""
    real_bmm = torch.bmm

    def nudged(a, b, out=None):
        got = real_bmm(a, b)
        got = got.nextafter(torch.full_like(got, float("inf"))) if when(a) else got
        return got if out is None else out.copy_(got)

    monkeypatch.setattr(batched, "_PROVEN", {})
    monkeypatch.setattr(torch, "bmm", nudged)


def test_a_short_last_batch_gives_every_row_the_whole_batches_bits(threads):
    """A kind's items past its last whole batch run as one short call (ItemTiles.short) where proven: at
    SmolLM2's attention shape, a decode step of one question, of a few, and prefills equal the same passes in
    whole batches bit for bit, whatever counts the device's kernels prove (every one on this CPU; which is a fact of
    the CPU and the torch build, and `test_short_batches_and_tiles_are_taken_where_the_kernels_prove_them`
    shows they are taken where proven)."""
    for kind in (CPU_ATTENTION.whole, CPU_ATTENTION.partial):
        assert set(proven_batches(kind, 64, torch.float32, DEVICE)) <= set(kind.short)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    for doc, qs, decode in SHORT_CASES:
        plan, short, whole = _short_and_whole(config, doc, qs, decode)
        assert torch.equal(short, whole), (doc, qs, decode)


SHORT_CASES = [(567, [1], True), (150, [3, 20], True), (700, [1] * 9, True), (0, [5], False),
               (300, [20, 45, 7], False), (64, [64], False)]


def test_a_short_batch_of_other_bits_is_refused(monkeypatch):
    """Negative control: a library whose calls of fewer items add in another order (here: `torch.bmm`
    nudging the last bit below 64 items) proves no short batch, so the pass keeps whole batches and their
    bits; taken unproven, the short batches would have changed them."""
    _nudge_bmm(monkeypatch, lambda a: a.shape[0] < CPU_ATTENTION.whole.batch)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    plan, short, whole = _short_and_whole(config, 567, [1], True)
    assert plan.whole.count % CPU_ATTENTION.whole.batch == plan.partial.count % CPU_ATTENTION.partial.batch == 0
    assert torch.equal(short, whole) and {v for k, v in batched._PROVEN.items() if k.kind == "batches"} == {()}
    monkeypatch.setattr(batched, "proven_batches", lambda kind, d, dtype, device: kind.short)  # taken unproven
    plan, short, whole = _short_and_whole(config, 567, [1], True)
    assert plan.whole.count % CPU_ATTENTION.whole.batch and not torch.equal(short, whole)


def test_one_kind_of_device_makes_each_proof_once(monkeypatch):
    """A proof of attention's short sizes is kept by the device's kind, as the linear products' are: a cache
    on "cuda:0" and a test's "cuda" (here "cpu:0" and "cpu") read one proof, not two of the same answer."""
    monkeypatch.setattr(batched, "_PROVEN", {})
    kind = ItemTiles(rows=8, batch=4, chunk=64, short=(2,), short_rows=(4,))
    for device in (torch.device(DEVICE.type), torch.device(DEVICE.type, 0)):
        proven_batches(kind, 16, torch.float32, device), proven_rows(kind, 16, torch.float32, device)
    assert sorted(key.kind for key in batched._PROVEN) == ["batches", "rows"]
    assert {key.device for key in batched._PROVEN} == {DEVICE.type}


def test_a_pass_of_small_groups_takes_short_item_tiles_with_the_whole_tiles_bits(threads):
    """Where every group of a kind's rows fits a smaller proven tile (ItemTiles.short_rows), a pass takes it;
    each pass equals the same pass in whole tiles bit for bit, whatever tiles the device's kernels prove (every
    one here; the tiles a pass then takes: `test_short_batches_and_tiles_are_taken_where_the_kernels_prove_them`)."""
    for kind in (CPU_ATTENTION.whole, CPU_ATTENTION.partial):
        assert set(proven_rows(kind, 64, torch.float32, DEVICE)) <= set(kind.short_rows)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    for doc, qs, decode, _ in [*SMALL_GROUPS, (100, [40] + [3] * 6, True, None)]:
        plan, short, whole = _short_and_whole(config, doc, qs, decode)
        assert torch.equal(short, whole), (doc, qs, decode)


# (document, questions, decode step?, the (whole, partial) item tiles a pass takes where every tile is proven)
SMALL_GROUPS = [(567, [1], True, (4, 4)), (150, [3, 20], True, (8, 4)), (700, [1] * 9, True, (32, 4)),
                (300, [20, 45, 7], False, (32, 16))]


def test_short_batches_and_tiles_are_taken_where_the_kernels_prove_them(monkeypatch):
    """Positive control of the proofs, on any device: with a stand-in `torch.bmm` and row sums that add each
    output's terms in one fixed order, element by element, whatever the call's shape (so every item's and
    every row's bits are their own by construction), every short batch and short tile proves, passes of few
    items take short batches, and a pass takes the smallest tile that holds its largest group: one question's
    decode step tiles its 3 rows a block as 4, not 32 and 8; two questions meet the document's blocks in 6
    rows (a tile of 8); nine in 27 and a prefill keep whole tiles. A proof that refused everything (every
    decode step back to 29 rows of padding a block) fails here."""
    def bmm(a, b, out=None):
        got = a[:, :, :1] * b[:, :1, :]
        for k in range(1, a.shape[2]):
            got = got + a[:, :, k:k + 1] * b[:, k:k + 1, :]
        return got if out is None else out.copy_(got)

    def row_sums(e, batch):
        got = e[..., :1]
        for k in range(1, e.shape[-1]):
            got = got + e[..., k:k + 1]
        return got

    monkeypatch.setattr(batched, "_PROVEN", {})
    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(batched, "_row_sums", row_sums)
    for kind in (CPU_ATTENTION.whole, CPU_ATTENTION.partial):
        assert proven_batches(kind, 64, torch.float32, DEVICE) == kind.short
        assert proven_rows(kind, 64, torch.float32, DEVICE) == kind.short_rows
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    shortened = 0
    for doc, qs, decode in SHORT_CASES:
        plan, short, whole = _short_and_whole(config, doc, qs, decode)
        assert torch.equal(short, whole), (doc, qs, decode)
        shortened += any(items.count % kind.batch for items, kind in
                         ((plan.whole, CPU_ATTENTION.whole), (plan.partial, CPU_ATTENTION.partial)))
    assert shortened >= 3
    for doc, qs, decode, tiles in SMALL_GROUPS:
        plan, short, whole = _short_and_whole(config, doc, qs, decode)
        assert (plan.whole.rows.shape[1], plan.partial.rows.shape[1]) == tiles, (doc, qs, decode)
        assert torch.equal(short, whole), (doc, qs, decode)
    # Mixed: the first question has passed a block of its own (positions 64-127, 3 rows) while all seven meet
    # the document's block 0 (21 rows): its own block goes apart in a 4-row tile, the shared one in 32.
    plan, short, whole = _short_and_whole(config, 100, [40] + [3] * 6, True)
    assert (plan.whole.rows.shape[1], plan.small.rows.shape[1], plan.partial.rows.shape[1]) == (32, 4, 4)
    assert plan.small.blocks == [1] and torch.equal(short, whole)


# (document, questions, the whole items' tiles, the first proven taken, else 32): decode steps whose groups are big
# but make no run, their items padded to calls of a batch (64), or to a proven short one (8, 16, 32). The document's
# 21 blocks meet 21 x 3 rows: one tile of 64 a block (63 items, a batch), not two of 32 (126 items, two batches).
# 30 x 3 at 8 blocks: 72 tiles of 32 (a batch and a call of 8), or 48 of 64 in a batch (1.8x the rows), 24 of 96 in
# a call of 32, so no long tile; at 21 blocks 189 tiles of 32 take three batches, 63 of 96 one: 96. 21 x 3 beside a
# question's own block (3 rows, apart in a short tile): 64. 64 x 3 at 8 blocks: 3 tiles of 64 a block, since 24 of
# 192 would take a call of 32 (1/3 more rows); at 32 blocks one of 192 (96 items: a batch and a call of 32, as many
# rows as tiles of 32). 32 x 3 at 32 blocks: one of 96 a block; at 8 blocks none (24 of 96 would take a call of 32,
# 48 of 64 a batch, where 72 of 32 take a batch and 8). Where tiles of 32 take one call (21 x 3 at 3 blocks, 30 x 3
# at 4), a long tile would save none: the pass keeps tiles of 32 (and proves no long one).
LONG_GROUPS = [(1344, [1] * 21, (64,)), (512, [1] * 30, ()), (1344, [1] * 30, (96,)), (1280, [70] + [1] * 20, (64,)),
               (512, [1] * 64, (64,)), (2048, [1] * 64, (192, 64)), (2048, [1] * 32, (96,)), (512, [1] * 32, ()),
               (200, [1] * 21, ()), (300, [1] * 30, ())]


def test_a_pass_of_big_groups_takes_long_item_tiles_with_the_whole_tiles_bits(threads):
    """Where a pass's whole-block groups are big but too few rows for a run, it takes the largest proven bigger
    tile (ItemTiles.long_rows) whose items, padded to their calls, hold at most 1/8 more rows than tiles of 32:
    63 rows a block, 21 questions, go as one 64-row tile rather than two of 32; 90 rows stay in 32-row tiles
    where 64 would compute 1.8x the rows; 192 rows a block take one tile of 192 where its items fill their
    calls, three of 64 where they would leave a call a third empty; 96 rows one tile of 96 likewise; a pass
    whose tiles of 32 take one call keeps them. Each pass
    equals the same pass in whole 32-row tiles, bit for bit. The test that a long tile of other bits is refused
    fails if taken unproven."""
    assert CPU_ATTENTION.whole.long_rows == (64, 96, 192)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    proven = {t: 32 in proven_rows(dataclasses.replace(CPU_ATTENTION.whole, rows=t, short_rows=(32,), long_rows=()),
                                   64, torch.float32, DEVICE) for t in (64, 96, 192)}
    for doc, qs, tiles in LONG_GROUPS:
        plan, long, whole = _short_and_whole(config, doc, qs, True)
        assert plan.whole.rows.shape[1] == next((t for t in tiles if proven[t]), 32), (doc, len(qs))
        assert torch.equal(long, whole), (doc, len(qs))


def _long_tile_by_proofs_first(kind: ItemTiles, group_rows: list[int], heads: int) -> int:
    """The rows of the tile `batched.long_tile` takes, by its rule read plainly: where tiles of 32 take more than one
    call, the largest long tile proven to give the whole tiles' bits whose items, padded to their calls, hold at
    most 1/8 more rows than tiles of 32."""
    def padded(k: ItemTiles) -> int:
        count = heads * sum(-(-n // k.rows) for n in group_rows)
        return batched.batch_items(k, 64, count, torch.float32, DEVICE) * k.rows

    if kind.runs and max(group_rows) >= kind.runs * kind.rows or padded(kind) <= kind.batch * kind.rows:
        return kind.rows  # a run; or one call of tiles of 32
    for t in sorted(kind.long_rows, reverse=True):
        long = dataclasses.replace(kind, rows=t, short_rows=(kind.rows,), long_rows=())
        if (kind.rows in proven_rows(long, 64, torch.float32, DEVICE)
                and padded(dataclasses.replace(long, short_rows=())) * 8 <= padded(kind) * 9):
            return t
    return kind.rows


@given(big=st.lists(st.integers(32, 600), min_size=1, max_size=6), small=st.lists(st.integers(1, 31), max_size=70),
       heads=st.integers(1, 3))
@example(big=[350, 281], small=[4, 14, 20, 18, 14, 30, 4, 22, 10, 9, 8, 13, 24], heads=3)  # 64: 9/8 the rows of 32
@settings(max_examples=40, deadline=None)
def test_a_long_item_tile_is_the_one_the_proofs_first_rule_takes(big, small, heads):
    """`batched.long_tile` passes over, unproven, a long tile whose rows alone hold too many: it takes the tile
    that proving every long tile first would take, for any groups; the example takes tiles of 64 whose rows
    alone are exactly 1/8 more than tiles of 32 take."""
    kind = CPU_ATTENTION.whole
    taken = batched.long_tile(kind, 64, big + small, heads, torch.float32, DEVICE)
    assert taken.rows == _long_tile_by_proofs_first(kind, big + small, heads), (big, small, heads)


def test_a_long_tile_that_could_not_be_taken_is_not_proven(monkeypatch):
    """No long tile is proven where it could not be taken: 20 questions' own small groups (3 rows each) beside a
    document block they share (96 rows), where tiles of 64, 96 or 192 would compute 2-6x the rows of tiles of 32;
    or one block of 99 rows (the README's example's first pass), whose 12 tiles of 32 take one call, which no
    long tile would save. Those proofs took ~0.4 s of a process's first pass; tiles of 32 need their own anyway."""
    kind = CPU_ATTENTION.whole
    for groups in ([96] + [3] * 20, [99]):
        monkeypatch.setattr(batched, "_PROVEN", {})
        assert batched.long_tile(kind, 64, groups, 3, torch.float32, DEVICE) == kind
        assert {key.kind for key in batched._PROVEN} <= {"batches"}, groups
        assert all(key.tiles.rows == kind.rows for key in batched._PROVEN), (groups, sorted(batched._PROVEN))


@pytest.mark.skipif(DEVICE.type != "cpu", reason="expects this CPU's proof of 64-row item tiles")
def test_a_long_item_tile_of_other_bits_is_refused(monkeypatch):
    """Negative control: a library whose products of 64-row tiles add in another order (here: `torch.bmm`
    nudging the last bit) proves no 64-row tile, so a decode step of 21 questions on a 1,344-token document
    keeps 32-row tiles, with the
    whole tiles' bits; taken unproven, the 64-row tiles would have changed them."""
    _nudge_bmm(monkeypatch, lambda a: a.shape[1] == 64)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    plan, long, whole = _short_and_whole(config, 1344, [1] * 21, True)
    assert plan.whole.rows.shape[1] == 32 and torch.equal(long, whole)
    monkeypatch.setattr(plan_module, "long_tile", lambda kind, d, rows, heads, dtype, device:
                        dataclasses.replace(kind, rows=64, short_rows=(), long_rows=()))  # unproven
    plan, long, whole = _short_and_whole(config, 1344, [1] * 21, True)
    assert plan.whole.rows.shape[1] == 64 and not torch.equal(long, whole)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="expects this CPU's proof of 8-row item tiles")
def test_a_short_item_tile_of_other_bits_is_refused(monkeypatch):
    """Negative control: a library whose products of 4-row tiles add in another order (here: `torch.bmm`
    nudging the last bit) proves no 4-row tile, so one question's decode step takes 8-row tiles, with the
    whole tiles' bits; taken unproven, the 4-row tiles would have changed them."""
    _nudge_bmm(monkeypatch, lambda a: a.shape[1] == 4)
    config = tiny_config(heads=9, kv_heads=3, head_dim=64)
    plan, short, whole = _short_and_whole(config, 567, [1], True)
    assert (plan.whole.rows.shape[1], plan.partial.rows.shape[1]) == (8, 8) and torch.equal(short, whole)
    monkeypatch.setattr(plan_module, "proven_rows", lambda kind, d, dtype, device: kind.short_rows)  # unproven
    plan, short, whole = _short_and_whole(config, 567, [1], True)
    assert (plan.whole.rows.shape[1], plan.partial.rows.shape[1]) == (4, 4) and not torch.equal(short, whole)


def test_both_ways_of_adding_a_blocks_terms_give_the_same_bits():
    """`AttentionTiles.index_add` (a GPU's one launch) or gather-add-put (a CPU's): one IEEE addition either way."""
    config = tiny_config(heads=6, kv_heads=2, head_dim=16)
    cache, segs, poss = layout(config, 300, [20, 45, 7], [90])
    rows = -(-len(segs) // 64) * 64
    plan = plan_attention(cache, segs, poss, 3, n_rows=rows, tiles=CPU_ATTENTION)
    q = fill(cache, rows, 3, 1)
    gpu_way = dataclasses.replace(CPU_ATTENTION, index_add=True)  # only the way of adding changes
    assert gpu_way.index_add and not CPU_ATTENTION.index_add
    assert torch.equal(blocked_attention(q, cache.k[0], cache.v[0], plan, CPU_ATTENTION),
                       blocked_attention(q, cache.k[0], cache.v[0], plan, gpu_way))


def test_a_window_cuts_blocks_on_the_left_and_skips_blocks_before_it():
    """Position 150 with a window of 100 sees 51 .. 150: block 0 cut on the left (51 .. 63), block 1 whole,
    block 2 cut on the right (128 .. 150); with a window of 23, blocks 0 and 1 are not visited at all."""
    assert visible_blocks(150, None) == (range(0, 2), [2])
    whole, cut = visible_blocks(150, 100)  # first visible position 51
    assert list(whole) == [1] and cut == [0, 2]
    assert visible_blocks(150, 23) == (range(3, 2), [2])  # 128 .. 150: one block, cut on the right only
    assert visible_blocks(140, 5) == (range(3, 2), [2])  # 136 .. 140: one block cut on both sides
    assert visible_blocks(127, 64) == (range(1, 2), [])  # 64 .. 127: exactly one whole block
    assert visible_blocks(127, 65) == (range(1, 2), [0])  # 63 .. 127: one key of block 0


def test_the_reference_without_the_window_differs():
    """Negative control: the window changes the answer, so a kernel that ignored it would be caught."""
    config = tiny_config(heads=2, kv_heads=2, head_dim=8)
    cache, segs, poss = layout(config, 150, [20], [])
    n = len(segs)
    plan = plan_attention(cache, segs, poss, 1, n_rows=n, tiles=SMALL_TILES.attention, window=40)
    q = fill(cache, n, 1, 0)
    windowed = blocked_attention(q, cache.k[0], cache.v[0], plan, SMALL_TILES.attention)
    full = blocked_attention(q, cache.k[0], cache.v[0], plan_attention(cache, segs, poss, 1, n, SMALL_TILES.attention),
                             SMALL_TILES.attention)
    assert torch.equal(windowed[:, :40], full[:, :40])  # the first 40 positions see the same keys
    assert ((windowed[:, 40:] - full[:, 40:]).abs().amax(dim=-1) > 0).all()  # every later row differs
