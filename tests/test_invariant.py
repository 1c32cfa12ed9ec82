"""The tiled linear: a row's bits do not depend on the other rows, their number or their order."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.invariant import ROW_TILE, linear


@settings(max_examples=60, deadline=None)
@given(k=st.sampled_from([8, 24, 64, 96, 576]), n=st.sampled_from([8, 61, 192, 576, 1536]),
       m=st.integers(1, 3 * ROW_TILE + 5), seed=st.integers(0, 1000))
def test_rows_are_batch_invariant(k, n, m, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    full = linear(x, w)
    perm = torch.randperm(m, generator=g)
    assert torch.equal(linear(x[perm], w), full[perm])
    for i in {0, m // 2, m - 1}:
        assert torch.equal(linear(x[i:i + 1], w)[0], full[i])
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=1e-4)


def test_keeps_leading_shape():
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    assert linear(x, w).shape == (2, 3, 5)
    assert torch.equal(linear(x, w, invariant=False), x @ w.T)


def test_a_lone_tile_equals_a_tile_among_many():
    """With 2 threads MKL splits one (64, 1536) x (1536, 576) product differently from a batch of them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=g)
    x = torch.randn(5 * ROW_TILE, 1536, generator=g)
    full = linear(x, w)
    for lo in (0, ROW_TILE, 3 * ROW_TILE):
        assert torch.equal(linear(x[lo:lo + ROW_TILE], w), full[lo:lo + ROW_TILE])
        assert torch.equal(linear(x[lo:lo + 1], w), full[lo:lo + 1])
