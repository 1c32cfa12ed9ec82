"""The KV cache: segment rules, slots, a document stored once."""

import pytest
import torch

from minillama.cache import PAD_SLOT, KVCache
from tiny import tiny_config


def test_positions_continue_from_parent_and_rules_are_enforced():
    cache = KVCache(tiny_config(), capacity=8)
    doc = cache.new_segment()
    q1, q2 = cache.new_segment(doc), cache.new_segment(doc)
    cache.append(torch.tensor([doc] * 5), torch.arange(5))
    assert cache.length(q1) == cache.length(q2) == 5
    cache.append(torch.tensor([q1, q1, q2]), torch.tensor([5, 6, 5]))
    assert cache.chain(q1) == [doc, q1]
    with pytest.raises(ValueError, match="cannot grow after its children"):
        cache.append(torch.tensor([doc]), torch.tensor([5]))
    with pytest.raises(ValueError, match="expects position 7, got 9"):
        cache.append(torch.tensor([q1]), torch.tensor([9]))
    with pytest.raises(ValueError, match="live children"):
        cache.release(doc)


def test_release_recycles_slots_and_growth_keeps_contents():
    cache = KVCache(tiny_config(), capacity=4)
    a = cache.new_segment()
    slots = cache.append(torch.tensor([a] * 3), torch.arange(3))
    assert PAD_SLOT not in slots.tolist()
    cache.k[0][:, slots] = 1.0
    b = cache.new_segment()
    more = cache.append(torch.tensor([b] * 10), torch.arange(10))  # grows past capacity
    assert len(set(slots.tolist() + more.tolist())) == 13
    assert torch.all(cache.k[0][:, slots] == 1.0) and torch.all(cache.k[:, :, PAD_SLOT] == 0)
    used = cache.used_bytes()
    cache.release(b)
    assert cache.used_bytes() == used * 3 // 13
    c = cache.new_segment()
    assert set(cache.append(torch.tensor([c] * 10), torch.arange(10)).tolist()) == set(more.tolist())


def test_reserve_makes_room_in_one_reallocation_and_keeps_contents():
    cache = KVCache(tiny_config(), capacity=5)
    a = cache.new_segment()
    slots = cache.append(torch.tensor([a] * 3), torch.arange(3))
    cache.k[0][:, slots] = 1.0
    cache.reserve(100)
    assert cache.k.shape[2] == 105  # its 5 slots all held (padding, spill + 3 tokens): exactly 100 more, not doubled
    before = cache.k.data_ptr()
    more = cache.append(torch.tensor([a] * 100), torch.arange(3, 103))  # fits: no further reallocation
    assert cache.k.data_ptr() == before and len(set(slots.tolist() + more.tolist())) == 103
    assert torch.all(cache.k[0][:, slots] == 1.0) and torch.all(cache.k[:, :, PAD_SLOT] == 0)
    cache.reserve(0)
    assert cache.k.data_ptr() == before


def test_document_is_stored_once():
    config = tiny_config()
    cache = KVCache(config)
    doc = cache.new_segment()
    cache.append(torch.tensor([doc] * 100), torch.arange(100))
    for _ in range(10):
        q = cache.new_segment(doc)
        cache.append(torch.tensor([q] * 3), torch.arange(100, 103))
    per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * 2
    assert cache.used_bytes() == (100 + 10 * 3) * per_token


def test_a_bad_token_late_in_a_call_leaves_the_cache_as_it_was():
    cache = KVCache(tiny_config(), capacity=8)
    doc = cache.new_segment()
    q = cache.new_segment(doc)
    cache.append(torch.tensor([doc] * 3), torch.arange(3))
    free, before = list(cache._free), {s: (g.start, list(g.slots), g.children) for s, g in cache.segments.items()}
    for segs, poss, err in [([doc, doc, q, 99], [3, 4, 5, 0], KeyError),  # unknown segment last
                            ([doc, q, q, q], [3, 4, 5, 9], ValueError),  # a gap last
                            ([q, q, doc], [3, 4, 3], ValueError)]:  # the parent grows after its child
        with pytest.raises(err):
            cache.append(torch.tensor(segs), torch.tensor(poss))
        assert cache._free == free
        assert {s: (g.start, g.slots, g.children) for s, g in cache.segments.items()} == before
    # The same tokens without the bad one go in, starting where the failed calls would have.
    assert cache.append(torch.tensor([doc, doc, q]), torch.tensor([3, 4, 5])).numel() == 3
    assert cache.segments[q].start == 5 and cache.segments[doc].children == 1


@pytest.mark.parametrize("capacity, error", [(10.5, TypeError), ("8", TypeError), (True, TypeError), (None, TypeError),
                                             (2.5, TypeError), (-5, ValueError)])
def test_a_capacity_that_is_not_a_count_of_slots_is_refused_in_one_line(capacity, error):
    """new_cache(10.5) met torch's unpacking error, new_cache("8") a '>' between str and int, and -5 or 2.5 were
    taken without a word: one line naming capacity, from the model and from KVCache alike."""
    from tiny import tiny_model

    for make in (tiny_model(tiny_config()).new_cache, lambda c: KVCache(tiny_config(), c)):
        with pytest.raises(error, match=rf"^capacity must be an integer >= 0 \(cache slots\), got {capacity!r}$"):
            make(capacity)
    assert KVCache(tiny_config(), 0).k.shape[2] == 3 and KVCache(tiny_config(), torch.tensor(8)).k.shape[2] == 8


def test_a_parent_that_is_not_a_segment_id_is_refused_naming_parent():
    """new_segment("0") said 'parent segment 0 does not exist' (a KeyError) though segment 0 did; a bool was
    taken as the segment id 0 or 1."""
    import numpy as np

    cache = KVCache(tiny_config(), capacity=8)
    root = cache.new_segment()
    for bad in ("0", True, 0.0, [0]):
        with pytest.raises(TypeError, match=r"^parent must be a segment id \(an integer\) or None, got "):
            cache.new_segment(bad)
    assert cache.segments.keys() == {root}
    child = cache.new_segment(np.int64(root))
    assert cache.segments[child].parent == root and type(cache.segments[child].parent) is int
