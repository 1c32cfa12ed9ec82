"""The tiled linear: a row's bits do not depend on the other rows, their number or their order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama import precision
from minillama.invariant import CPU_TILES, Kernels, TiledLinear, Tiles, linear, tiled_linear
from minillama.precision import onednn_linear
from tiny import DEVICE, tiny_config, tiny_model

ROW_TILE = CPU_TILES.rows


@settings(max_examples=60, deadline=None)
@given(k=st.sampled_from([8, 24, 64, 96, 576]), n=st.sampled_from([8, 61, 192, 576, 1536]),
       m=st.integers(1, 3 * ROW_TILE + 5), seed=st.integers(0, 1000))
def test_rows_are_batch_invariant(k, n, m, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(DEVICE), torch.randn(n, k, generator=g).to(DEVICE)
    full = tiled_linear(x, w, ROW_TILE)
    perm = torch.randperm(m, generator=g).to(DEVICE)
    assert torch.equal(tiled_linear(x[perm], w, ROW_TILE), full[perm])
    for i in {0, m // 2, m - 1}:
        assert torch.equal(tiled_linear(x[i:i + 1], w, ROW_TILE)[0], full[i])
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("gemm", ["mm", "onednn"])
def test_keeps_leading_shape(gemm, monkeypatch):
    """The plain product is one call for the whole pass, in the library the tiles use (so that plain and
    invariant runs differ by the tiling alone): torch's matmul, or on a CPU in float32 oneDNN's linear."""
    if gemm == "onednn" and not precision.onednn_available():
        pytest.skip("this torch has no working oneDNN linear")
    monkeypatch.setenv(precision.GEMM_ENV, gemm)
    x, w = torch.randn(2, 3, 8), torch.randn(5, 8)
    assert linear(x, w).shape == (2, 3, 5)
    one_call = onednn_linear(x.view(6, 8), w).view(2, 3, 5) if gemm == "onednn" else x @ w.T
    assert torch.equal(linear(x, w, invariant=False), one_call)


def test_a_lone_tile_equals_a_tile_among_many():
    """With 2 threads MKL splits one (64, 1536) x (1536, 576) product differently from a batch of them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, 1536, generator=g).to(DEVICE)
    x = torch.randn(5 * ROW_TILE, 1536, generator=g).to(DEVICE)
    full = tiled_linear(x, w, ROW_TILE)
    for lo in (0, ROW_TILE, 3 * ROW_TILE):
        assert torch.equal(tiled_linear(x[lo:lo + ROW_TILE], w, ROW_TILE), full[lo:lo + ROW_TILE])
        assert torch.equal(tiled_linear(x[lo:lo + 1], w, ROW_TILE), full[lo:lo + 1])


def test_tiled_linear_module_reads_the_shared_switch():
    kernels = Kernels(tiles=Tiles(rows=16))
    layer = TiledLinear(24, 40, kernels).to(DEVICE)
    x = torch.randn(37, 24).to(DEVICE)
    assert torch.equal(layer(x), tiled_linear(x, layer.weight, 16))
    kernels.invariant = False
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


def test_forward_hooks_see_every_projection():
    """The projections are modules that run: hooks on q/k/v/o/gate/up/down see their inputs and outputs."""
    config = tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8)
    model = tiny_model(config, 0)
    seen = {}

    def hook(name):
        def record(module, args, out):
            seen.setdefault(name, (args[0].clone(), out.clone()))
        return record

    names = [n for n, m in model.named_modules() if isinstance(m, TiledLinear)]
    assert len(names) == 2 * 7 + 1  # 7 per layer and the LM head
    for n in names:
        model.get_submodule(n).register_forward_hook(hook(n))
    model(torch.arange(3, 23))
    assert set(seen) == set(names)
    for n in names:
        x, out = seen[n]
        with torch.inference_mode():
            assert torch.equal(out, model.get_submodule(n)(x))  # what ran is what the module computes
