"""The blocked kernel computes the segment rule's attention, and shares document blocks across questions."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.attention import FULL_TILE, KEY_BLOCK, PARTIAL_TILE, blocked_attention, masked_attention, plan_attention
from minillama.cache import KVCache
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
    """Hydragen: in a decode step of 40 questions, a document block is one group of 40 queries."""
    config = tiny_config(heads=3, kv_heads=1, head_dim=8)
    cache = KVCache(config)
    doc_len = 5 * KEY_BLOCK
    doc = cache.new_segment()
    cache.append(torch.tensor([doc] * doc_len), torch.arange(doc_len))
    qs = [cache.new_segment(doc) for _ in range(40)]
    for q in qs:
        cache.append(torch.tensor([q] * 4), torch.arange(doc_len, doc_len + 4))
    plan = plan_attention(cache, torch.tensor(qs), torch.full((40,), doc_len + 4), 3, n_rows=64)
    doc_slots = set(cache.segments[doc].slots)
    full, partial = plan.items
    assert full.q_rows.shape[1] == FULL_TILE and partial.q_rows.shape[1] == PARTIAL_TILE
    for b in range(5):
        items = full.block == b
        rows = full.q_rows[items]
        # All 40 questions' 3 query heads, in ceil(120 / 64) = 2 tiles against the same key block.
        assert rows.shape[0] == 2 and set(rows[rows < 64 * 3].tolist()) == set(range(120))
        assert len({tuple(k.tolist()) for k in full.k_slots[items]}) == 1
        assert set(full.k_slots[items][0].tolist()) <= doc_slots
    # The block holding each question's own tokens is that question's alone, in a small tile.
    assert (full.block < 5).all() and (partial.block == 5).all() and partial.q_rows.shape[0] == 40
