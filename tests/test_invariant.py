"""The tiled linear: a row's bits do not depend on the other rows, their number or their order."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama import invariant, precision, proofs
from minillama.invariant import CPU_TILES, CUDA_TILES, Kernels, TiledLinear, Tiles, linear, tiled_linear
from minillama.proofs import proven_long, proven_short
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


SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536), (8192, 576)]  # SmolLM2's (N, K), an LM head's slice


@pytest.mark.skipif(DEVICE.type != "cpu", reason="CPU_TILES on a CPU's kernels (a GPU's: the test after)")
@pytest.mark.parametrize("gemm", ["mm", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_last_tile_gives_every_row_the_whole_tiles_bits(gemm, dtype, monkeypatch):
    """A pass's rows past its last whole tile run as a short tile (CPU_TILES.short) where proven: every row
    equals the row of the whole-tile product, at every row count, whatever sizes this CPU's kernels prove (a
    fact of the CPU and the torch build: here all of them under torch 2.13, two of four under 2.11's oneDNN;
    `test_a_row_independent_kernel_proves_every_short_and_long_size` shows the proof accepts where it
    should); a 16-bit product, whose rounding would hide another order, is never taken short."""
    if gemm == "onednn" and not precision.onednn_available():
        pytest.skip("this torch has no working oneDNN linear")
    monkeypatch.setenv(precision.GEMM_ENV, gemm)
    g = torch.Generator().manual_seed(1)
    tile, short = CPU_TILES.rows, CPU_TILES.short
    for n, k in SMOL:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(2 * tile, k, generator=g).to(dtype)
        for m in (1, 2, 7, 8, 9, 16, 31, 33, 63, 64, 65, 72, 100, 127):
            assert torch.equal(tiled_linear(x[:m], w, tile, short), tiled_linear(x[:m], w, tile)), (n, k, m)
        p = w if gemm == "onednn" and dtype == torch.float32 else w.t()
        proven = proven_short(p, tile, short, gemm == "onednn" and dtype == torch.float32)
        assert set(proven) <= set(short) and (dtype == torch.float32 or proven == ()), (n, k, proven)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_tiles_short_tiles_give_every_row_the_whole_tiles_bits(dtype):
    """The GPU's tiles (CUDA_TILES: 256 rows, short tiles of 16 to 128 where proven), on the test device: every
    row count gives every row the whole tile's bits, whatever sizes the device proves for each weight (a
    GPU proves 16-bit products too, on cancelling rows; a CPU float32 ones only); shapes of SmolLM2 and of
    Llama-3-8B's attention projections."""
    g = torch.Generator().manual_seed(4)
    tile, short = CUDA_TILES.rows, CUDA_TILES.short
    for n, k in [*SMOL[:4], (1024, 4096)]:
        w = torch.randn(n, k, generator=g).mul_(0.02).to(DEVICE, dtype)
        x = torch.randn(2 * tile, k, generator=g).to(DEVICE, dtype)
        for m in (1, 7, 16, 17, 33, 64, 65, 100, 128, 129, 200, 256, 300):
            assert torch.equal(tiled_linear(x[:m], w, tile, short), tiled_linear(x[:m], w, tile)), (n, k, m)


def test_a_row_independent_kernel_proves_every_short_and_long_size(monkeypatch):
    """Positive control of the two proofs: a library whose products give each row the same bits at every row
    count (here: `torch.mm` issued one row at a time) proves every short and every long size, so a proof that
    refused everything (and made every CPU pass pay for whole tiles) would fail here, on any CPU."""
    monkeypatch.setenv(precision.GEMM_ENV, "mm")
    real_mm = torch.mm

    def by_row(r, p, out=None):
        got = torch.cat([real_mm(r[i:i + 1], p) for i in range(r.shape[0])])
        return got if out is None else out.copy_(got)

    monkeypatch.setattr(proofs, "_PROVEN", {})
    monkeypatch.setattr(torch, "mm", by_row)
    w = torch.randn(192, 576, generator=torch.Generator().manual_seed(3))
    assert proven_short(w.t(), CPU_TILES.rows, CPU_TILES.short, False) == CPU_TILES.short
    assert proven_long(w.t(), CPU_TILES.rows, CPU_TILES.long, False) == CPU_TILES.long


@pytest.mark.parametrize("tiles", [CPU_TILES, CUDA_TILES], ids=["cpu_tiles", "gpu_tiles"])
def test_a_short_tile_of_other_bits_is_refused(tiles, monkeypatch):
    """Negative control: a library whose fewer-row products add in another order (here: `torch.mm` nudging
    the last bit below a tile's rows) proves no short tile, so the pass keeps the whole tile's bits; taken
    unproven, the short tile would have changed them. With the CPU's tiles and the GPU's."""
    monkeypatch.setenv(precision.GEMM_ENV, "mm")
    real_mm = torch.mm

    def nudged(r, p, out=None):
        got = real_mm(r, p)
        got = got.nextafter(torch.full_like(got, float("inf"))) if r.shape[0] < tiles.rows else got
        return got if out is None else out.copy_(got)

    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(576, 576, generator=g), torch.randn(5, 576, generator=g)
    whole = tiled_linear(x, w, tiles.rows)
    monkeypatch.setattr(proofs, "_PROVEN", {})
    monkeypatch.setattr(torch, "mm", nudged)
    assert torch.equal(tiled_linear(x, w, tiles.rows, tiles.short), whole)
    assert list(proofs._PROVEN.values()) == [()]
    monkeypatch.setattr(invariant, "proven_short", lambda p, tile, short, onednn: short)  # taken unproven
    assert not torch.equal(tiled_linear(x, w, tiles.rows, tiles.short), whole)


def test_a_16_bit_short_tile_of_another_order_is_refused_on_cancelling_rows(monkeypatch):
    """A GPU proves a 16-bit product's short tiles too (proofs.provable), on cancelling rows as well as random
    ones. A short product that adds along K in another order (a split-K stand-in: two float32 halves added,
    then rounded to bfloat16) changes most elements of the cancelling rows' products and few of the random
    rows' (whose rounding hides it), and is refused; the product in the whole tile's order is proven."""
    monkeypatch.setattr(proofs, "provable", lambda dtype, device, linear=False: True)  # as on a GPU
    monkeypatch.setattr(proofs, "_PROVEN", {})
    tile, real_mm = 64, torch.mm
    p = (torch.randn(512, 1024, generator=torch.Generator().manual_seed(7)) * 0.02).to(torch.bfloat16).t()

    def split_k(r, q, out=None):  # fewer rows than the tile: K added in two float32 halves
        h = r.shape[1] // 2
        got = real_mm(r, q) if r.shape[0] == tile else \
            (real_mm(r[:, :h].float(), q[:h].float()) + real_mm(r[:, h:].float(), q[h:].float())).to(r.dtype)
        return got if out is None else out.copy_(got)

    (x, _), (xc, pc) = proofs._operands(p, tile, False)
    for rows, q, lo, hi in ((x, p, 0.0, 0.001), (xc, pc, 0.3, 1.0)):
        differ = torch.cat([split_k(rows[i:i + 16], q) != real_mm(rows, q)[i:i + 16] for i in range(0, tile, 16)])
        assert lo <= differ.float().mean() <= hi
    monkeypatch.setattr(torch, "mm", split_k)
    assert proven_short(p, tile, (16,), False) == ()
    monkeypatch.setattr(torch, "mm", real_mm)
    monkeypatch.setattr(proofs, "_PROVEN", {})
    assert proven_short(p, tile, (16,), False) == (16,)  # this CPU's bfloat16 `mm`: one order at 16 rows


@pytest.mark.skipif(DEVICE.type != "cpu", reason="long tiles are a CPU's (invariant.CUDA_TILES has none)")
@pytest.mark.parametrize("gemm", ["mm", "onednn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runs_of_whole_tiles_as_long_products_give_every_row_its_tiles_bits(gemm, dtype, monkeypatch):
    """A pass's whole tiles run as long products of CPU_TILES.long rows where proven: every row equals the
    row of its own tile's product, at every row count, whatever sizes this CPU's kernels prove (all of them
    here under torch 2.13, none under 2.11's oneDNN: a big pass then goes one call per tile, slower, the
    same bits); a 16-bit product is never taken long."""
    if gemm == "onednn" and not precision.onednn_available():
        pytest.skip("this torch has no working oneDNN linear")
    monkeypatch.setenv(precision.GEMM_ENV, gemm)
    g = torch.Generator().manual_seed(5)
    tile, long = CPU_TILES.rows, CPU_TILES.long
    for n, k in SMOL:
        w = torch.randn(n, k, generator=g).to(dtype)
        x = torch.randn(1100, k, generator=g).to(dtype)
        for m in (128, 255, 256, 257, 320, 511, 512, 600, 1024, 1100):
            got = tiled_linear(x[:m], w, tile, CPU_TILES.short, long)
            assert torch.equal(got, tiled_linear(x[:m], w, tile)), (n, k, m)
        p = w if gemm == "onednn" and dtype == torch.float32 else w.t()
        proven = proven_long(p, tile, long, gemm == "onednn" and dtype == torch.float32)
        assert set(proven) <= set(long) and (dtype == torch.float32 or proven == ()), (n, k, proven)


def test_a_long_product_of_other_bits_is_refused(monkeypatch):
    """Negative control: a library whose products of more rows than a tile add in another order (here:
    `torch.mm` nudging the last bit above 64 rows) proves no long product, so the pass keeps its tiles' bits;
    taken unproven, the long product would have changed them."""
    monkeypatch.setenv(precision.GEMM_ENV, "mm")
    real_mm = torch.mm

    def nudged(r, p, out=None):
        got = real_mm(r, p)
        got = got.nextafter(torch.full_like(got, float("inf"))) if r.shape[0] > CPU_TILES.rows else got
        return got if out is None else out.copy_(got)

    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(576, 576, generator=g), torch.randn(600, 576, generator=g)
    tiles = tiled_linear(x, w, CPU_TILES.rows)
    monkeypatch.setattr(proofs, "_PROVEN", {})
    monkeypatch.setattr(torch, "mm", nudged)
    assert torch.equal(tiled_linear(x, w, CPU_TILES.rows, long=CPU_TILES.long), tiles)
    assert list(proofs._PROVEN.values()) == [()]
    monkeypatch.setattr(invariant, "proven_long", lambda p, tile, long, onednn: long)  # taken unproven
    assert not torch.equal(tiled_linear(x, w, CPU_TILES.rows, long=CPU_TILES.long), tiles)


def test_a_pass_pads_its_rows_to_the_smallest_short_tile_its_widths_allow():
    """Elementwise tensors stay whole multiples of 128 elements (no scalar tail; model.py): SmolLM2's widths
    take 4-row units, a RoPE half of 2 the whole tile; the plain kernels pad nothing."""
    smol = tiny_config(heads=9, kv_heads=3, head_dim=64)
    smol.hidden_size, smol.intermediate_size = 576, 1536
    kernels = Kernels()
    cpu = torch.device("cpu")
    assert kernels.row_unit(cpu, smol) == 4 and kernels.row_unit(cpu, tiny_config(head_dim=4)) == 64
    assert [CPU_TILES.tile_end(n) for n in (1, 4, 5, 9, 17, 33, 64, 65, 100)] == [4, 4, 8, 16, 32, 64, 64, 68, 128]
    kernels.invariant = False
    assert kernels.row_unit(cpu, smol) == 1 and kernels.tile_end(5, cpu) == 5


def _split_layer(units: int, n: int = 1536, k: int = 576) -> TiledLinear:
    """A column-split projection of `units` units, its weight column-major as a CPU model lays it out."""
    layer = TiledLinear(k, n, Kernels(units=units), split="columns").requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05)
    layer.weight.data = layer.weight.data.t().contiguous().t()
    return layer


def _each_unit(layer: TiledLinear, x: torch.Tensor) -> torch.Tensor:
    """The units' definition: each unit's own product on its row-major block, concatenated."""
    t = layer.kernels.tiles_for(x.device)
    return torch.cat([tiled_linear(x, layer.weight[a:b].contiguous(), t.rows, t.short, t.long)
                      for a, b in layer.unit_bounds()], dim=-1)


def test_a_column_split_layers_units_run_as_one_product_with_each_units_bits(monkeypatch):
    """With U > 1 units a column-split projection issues one product over all of them, column-major, where the
    process has proven that it gives each unit's features the bits of the unit's own row-major product
    (`proofs.proven_units`): the bits of U products, at every row count, for one product's calls."""
    monkeypatch.setattr(proofs, "_PROVEN", {})
    layer = _split_layer(units=3)
    x = torch.randn(700, 576, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        for m in (1, 3, 20, 64, 65, 200, 512, 700):
            assert torch.equal(layer(x[:m]), _each_unit(layer, x[:m])), m
        assert [v for key, v in proofs._PROVEN.items() if key.kind == "units"] == [True]
        calls = []
        real = invariant.tiled_linear
        monkeypatch.setattr(invariant, "tiled_linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
        layer(x[:200])
    assert calls == [(1536, 576)]  # one product over the three units, not three


def test_the_lm_heads_units_run_on_their_own_blocks_unproven(monkeypatch):
    """A CPU's LM head (row-major, maybe the embedding table) runs each unit's product on its block as it
    lies: the units' bits, three products, no units proof (which for SmolLM2's LM head cost ~2 s and ~370 MB
    at a process's first pass)."""
    monkeypatch.setattr(proofs, "_PROVEN", {})
    layer = _split_layer(units=3)
    layer.gather = True  # the LM head's: every unit's logits
    layer.weight.data = layer.weight.data.contiguous()  # row-major, as the LM head is
    x = torch.randn(200, 576, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        calls = []
        real = invariant.tiled_linear
        monkeypatch.setattr(invariant, "tiled_linear", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
        for m in (1, 65, 200):
            assert torch.equal(layer(x[:m]), _each_unit(layer, x[:m])), m
    assert not [key for key in proofs._PROVEN if key.kind == "units"]
    assert calls[:3] == [(512, 576)] * 3  # the first pass: one product per unit, on its block


def test_units_taken_as_one_product_of_other_bits_are_refused(monkeypatch):
    """Negative control: where one product over the units would add in another order (here: the whole
    weight's product nudged in its last bit), the proof fails and each unit runs its own product, so the
    bits stay the units'; taken unproven, the one product would have changed them."""
    monkeypatch.setattr(proofs, "_PROVEN", {})
    layer = _split_layer(units=3)
    x = torch.randn(100, 576, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want = _each_unit(layer, x)
        real = invariant.tiled_linear

        def nudged(r, w, *a, **kw):
            got = real(r, w, *a, **kw)
            return got.nextafter(torch.full_like(got, float("inf"))) if w.shape[0] == 1536 else got

        monkeypatch.setattr(invariant, "tiled_linear", nudged)
        assert torch.equal(layer(x), want)
        assert [v for key, v in proofs._PROVEN.items() if key.kind == "units"] == [False]
        monkeypatch.setattr(invariant, "proven_units", lambda *a: True)  # taken unproven
        assert not torch.equal(layer(x), want)


def test_a_pass_ends_at_the_short_tiles_no_proof_refused(monkeypatch):
    """`proofs.held_short`: the short tiles a pass's every weight takes, as far as the process's proofs tell
    (`Llama.rows_end`): all of them before any proof; then those no proof of the tile, dtype and device kind
    refused. A proof asked of fewer sizes leaves the others alone; proofs of other dtypes, tiles or devices
    count for nothing. Made by real proofs, with `torch.mm` nudged for products of 16 rows or more."""
    cpu, short = torch.device("cpu"), (4, 8, 16, 32)
    monkeypatch.setattr(proofs, "_PROVEN", {})
    assert proofs.held_short(64, short, torch.float32, cpu) == short
    real_mm = torch.mm

    def nudged(r, p, out=None):
        got = real_mm(r, p)
        got = got.nextafter(torch.full_like(got, float("inf"))) if 16 <= r.shape[0] < 64 else got
        return got if out is None else out.copy_(got)

    monkeypatch.setattr(torch, "mm", nudged)
    w = torch.randn(96, 40, generator=torch.Generator().manual_seed(0))
    assert proven_short(w.t(), 64, short, onednn=False) == (4, 8)
    assert proven_short(w[:48].t(), 64, (4, 8), onednn=False) == (4, 8)  # asked of 4 and 8 only
    assert proven_short(w.t(), 32, (4, 8, 16), onednn=False) == (16,)  # another tile, itself nudged
    assert proofs.held_short(64, short, torch.float32, cpu) == (4, 8)
    assert proofs.held_short(32, short, torch.float32, cpu) == (16, 32)
    assert proofs.held_short(64, short, torch.float32, torch.device("meta")) == short
    assert proofs.held_short(64, short, torch.bfloat16, cpu) == short


def test_held_short_reads_the_proofs_while_another_thread_adds_one(monkeypatch):
    """A server's pass asks `held_short` while a thread answering on another model proves its weights: the
    proof added while the proofs are read (here as the first one's kind is read) once raised 'dictionary changed
    size during iteration' in the pass."""
    cpu = torch.device("cpu")
    arriving = proofs.Proof("short", (40, 96), (1, 40), torch.float32, "cpu", 1, 64, (4, 8), False)

    class Reading(proofs.Proof):
        @property
        def kind(self):
            proofs._PROVEN[arriving] = (4,)  # another thread's proof, made meanwhile: it refuses 8
            return "short"

    first = Reading("short", (40, 48), (1, 40), torch.float32, "cpu", 1, 64, (4, 8), False)
    monkeypatch.setattr(proofs, "_PROVEN", {first: (4, 8)})
    assert proofs.held_short(64, (4, 8), torch.float32, cpu) == (4, 8)  # as the proofs stood when asked
    assert proofs.held_short(64, (4, 8), torch.float32, cpu) == (4,)
