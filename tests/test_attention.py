"""The blocked kernel computes the segment rule's attention, and shares document blocks across questions."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.attention import (FULL_TILE, KEY_BLOCK, PARTIAL_TILE, Run, blocked_attention, masked_attention,
                                 plan_attention)
from minillama.cache import PAD_SLOT, KVCache
from tiny import tiny_config


@settings(max_examples=40, deadline=None)
@given(doc=st.integers(0, 200), qs=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       others=st.lists(st.integers(1, 90), max_size=2), g=st.sampled_from([1, 3]), seed=st.integers(0, 99))
def test_blocked_equals_dense_float64_reference(doc, qs, others, g, seed):
    config = tiny_config(heads=2 * g, kv_heads=2, head_dim=8)
    cache = KVCache(config, dtype=torch.float64)
    # Document root, questions as its children, unrelated roots.
    pieces = ([(None, doc)] if doc else []) + [(0 if doc else None, n) for n in qs] + [(None, n) for n in others]
    sids, segs, poss = [], [], []
    for parent, length in pieces:
        sid = cache.new_segment(None if parent is None else sids[parent])
        start = doc if parent is not None else 0
        sids.append(sid)
        segs += [sid] * length
        poss += range(start, start + length)
    segs, poss = torch.tensor(segs), torch.tensor(poss)
    n = len(segs)
    plan = plan_attention(cache, segs, poss, g, n_rows=n, dense=True)
    gen = torch.Generator().manual_seed(seed)
    cache.k[0] = torch.randn(cache.k[0].shape, generator=gen, dtype=torch.float64)
    cache.v[0] = torch.randn(cache.v[0].shape, generator=gen, dtype=torch.float64)
    cache.k[0][:, 0] = cache.v[0][:, 0] = 0  # the padding slot
    q = torch.randn(2, n * g, 8, generator=gen, dtype=torch.float64)
    got = blocked_attention(q, cache.k[0], cache.v[0], plan)

    # Reference: per query, softmax over exactly the keys the segment rule allows, in float64.
    slot_of = {}
    for sid in sids:
        seg = cache.segments[sid]
        for i, slot in enumerate(seg.slots):
            slot_of[(sid, seg.start + i)] = slot
    for t in range(n):
        sid, p = int(segs[t]), int(poss[t])
        keys = [slot_of[(c, kp)] for c in cache.chain(sid) for kp in range(p + 1) if (c, kp) in slot_of]
        assert plan.visible[t].nonzero().flatten().tolist() == sorted(keys)
        k, v = cache.k[0][:, keys], cache.v[0][:, keys]  # (Hkv, K, D)
        for j in range(g):
            qr = q[:, t * g + j]  # (Hkv, D)
            w = torch.softmax((k @ qr[:, :, None])[..., 0] / 8 ** 0.5, dim=-1)
            torch.testing.assert_close(got[:, t * g + j], (w[..., None] * v).sum(1), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(masked_attention(q, cache.k[0], cache.v[0], plan), got, atol=1e-12, rtol=1e-12)


def test_decode_reads_each_document_block_once_for_all_questions():
    """Hydragen: in a decode step of 40 questions, the document's blocks are one run of 40 queries."""
    config = tiny_config(heads=3, kv_heads=1, head_dim=8)
    cache = KVCache(config)
    doc_len = 5 * KEY_BLOCK
    doc = cache.new_segment()
    cache.append(torch.tensor([doc] * doc_len), torch.arange(doc_len))
    qs = [cache.new_segment(doc) for _ in range(40)]
    for q in qs:
        cache.append(torch.tensor([q] * 4), torch.arange(doc_len, doc_len + 4))
    plan = plan_attention(cache, torch.tensor(qs), torch.full((40,), doc_len + 4), 3, n_rows=64)
    (run,) = plan.work
    # All 40 questions' 3 query heads, in ceil(120 / 64) = 2 tiles, against the 5 document blocks, whose
    # keys sit in consecutive slots: read in place, no gather.
    assert run.first_block == 0 and run.n_blocks == 5 and len(run.rows) == 2 * FULL_TILE
    assert set(run.rows[run.rows < 64 * 3].tolist()) == set(range(120))
    assert run.k_slots.tolist() == cache.segments[doc].slots and run.k_start == cache.segments[doc].slots[0]
    # The block holding each question's own tokens is that question's alone, in a small tile.
    p = plan.partial
    assert p.q_rows.shape == (40, PARTIAL_TILE) and (p.k_slots[:, 5:] == PAD_SLOT).all() and (p.block == 5).all()
    for w in range(40):
        assert set(p.k_slots[w].tolist()) - {PAD_SLOT} == set(cache.segments[qs[w]].slots)


def pairs_of(plan):
    """(row, block, key slots) of every whole-block pair in the plan, in the order the kernel adds them."""
    out = []
    for w in plan.work:
        if isinstance(w, Run):
            for t in w.rows.view(-1, FULL_TILE):
                for j in range(w.n_blocks):
                    out += [(int(r), w.first_block + j, tuple(w.k_slots[j * KEY_BLOCK:(j + 1) * KEY_BLOCK].tolist()))
                            for r in t]
        else:
            out += [(int(r), int(w.block[i]), tuple(w.k_slots[i].tolist()))
                    for i in range(len(w.q_rows)) for r in w.q_rows[i]]
    return out


def test_blocks_split_at_owners_and_keep_block_order():
    """A question longer than a block owns that block: its rows see the document's blocks, then their own."""
    config = tiny_config(heads=2, kv_heads=1, head_dim=8)
    cache = KVCache(config)
    doc = cache.new_segment()
    cache.append(torch.tensor([doc] * 130), torch.arange(130))  # blocks 0, 1 whole; block 2 partly
    long_q, short_q = cache.new_segment(doc), cache.new_segment(doc)
    cache.append(torch.tensor([short_q] * 3), torch.arange(130, 133))
    cache.append(torch.tensor([long_q] * 80), torch.arange(130, 210))  # reaches block 3 (192..255)
    plan = plan_attention(cache, torch.tensor([long_q, short_q]), torch.tensor([210, 133]), 2, n_rows=2, dense=True)
    doc_slots, long_slots = cache.segments[doc].slots, cache.segments[long_q].slots
    blocks: dict[int, list[tuple[int, tuple[int, ...]]]] = {}
    for r, b, keys in pairs_of(plan):
        if r < 4:  # row 4 is the padding row
            blocks.setdefault(r, []).append((b, keys))
    for r in (0, 1, 2, 3):  # every row: document blocks 0 and 1, in order, keys read from the document
        assert [(b, list(k)) for b, k in blocks[r][:2]] == [(0, doc_slots[:64]), (1, doc_slots[64:128])]
    # The long question's rows (token 0) also have block 2 whole: the document's last two slots, then its own.
    assert [b for b, _ in blocks[0]] == [0, 1, 2] and list(blocks[0][2][1]) == doc_slots[128:] + long_slots[:62]
    assert [b for b, _ in blocks[2]] == [0, 1]
    assert plan.partial.q_rows.shape == (2, PARTIAL_TILE) and plan.partial.block.tolist() == [3, 2]
    q = torch.randn(1, 4, 8)
    cache.k.normal_(), cache.v.normal_()
    torch.testing.assert_close(blocked_attention(q, cache.k[0], cache.v[0], plan),
                               masked_attention(q, cache.k[0], cache.v[0], plan))


def test_masked_block_bits_do_not_depend_on_how_its_items_are_batched(monkeypatch):
    """A prefill's own block reads its keys once for all its items; a decode step's are gathered per item.
    Both are the same (8 rows) x (64 keys) products: the bits agree."""
    import minillama.attention as attention

    config = tiny_config(heads=6, kv_heads=2, head_dim=16)

    def run(shared_from):
        monkeypatch.setattr(attention, "SHARED_ITEMS", shared_from)
        cache = KVCache(config)
        doc = cache.new_segment()
        cache.append(torch.tensor([doc] * 100), torch.arange(100))
        q = cache.new_segment(doc)
        plan = plan_attention(cache, torch.tensor([q] * 40), torch.arange(100, 140), 3, n_rows=64)
        gen = torch.Generator().manual_seed(0)
        cache.k[0] = torch.randn(cache.k[0].shape, generator=gen)
        cache.v[0] = torch.randn(cache.v[0].shape, generator=gen)
        queries = torch.randn(2, 64 * 3, 16, generator=gen)
        return plan, blocked_attention(queries, cache.k[0], cache.v[0], plan)

    shared_plan, shared = run(4)
    lone_plan, lone = run(10**9)
    assert shared_plan.partial_groups and shared_plan.partial is None
    assert lone_plan.partial is not None and not lone_plan.partial_groups
    assert torch.equal(shared[:, :120], lone[:, :120])
