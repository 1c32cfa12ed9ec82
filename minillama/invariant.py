"""Batch-invariant primitives: a row's result never depends on what else is in the batch.

A BLAS (MKL, oneDNN, cuBLAS) picks its kernel, blocking, thread split and split-K from the shapes, strides,
dtype and batch count of a product, so row i of `X @ W.T` can change in its last bits when X gains or
loses rows (docs/design.md has the measurements, on CPU and on a GPU). The rule every product of minillama
follows:

    each matrix product is issued with a signature (op, shapes, strides, dtype, batch count) that depends
    only on the model's config and the fixed tile sizes below, never on how many questions, documents or
    tokens share the pass.

Same signature in, same kernel out, so every row meets the same arithmetic in every layout. A test
(tests/test_signatures.py) records every product while answering many layouts and checks the set is fixed.

- Linear layers pad their rows to whole tiles of `Tiles.rows` and run one (rows, K) x (K, N) product per tile.
  (One `bmm` over all tiles is not enough: its batch count follows the number of tiles, and with 2 threads
  MKL splits a lone tile's product differently from a batch of them.) The one exception to "same signature":
  a pass's last tile may run as a short tile of fewer rows (`Tiles.short`), and only where the process has
  shown, product by product, that the short product gives each row exactly the whole tile's bits
  (`proven_short`). So a short tile changes which kernel runs, never a bit: the answer is the whole tiles'.
  In the same way, a run of whole tiles may go as one long product (`Tiles.long`) where the process has
  shown that it gives each row its own tile's bits (`proven_long`): fewer, bigger calls, the same bits.
- Attention (attention.py) runs its (query tile, key block) products in `bmm` calls of a fixed batch count.
- Order-dependent reductions are issued the same way: RMSNorm's mean of squares per tile of rows
  (`tiled_mean_square`), the softmax's sums per batch of items (batched.batched_row_sums). A GPU's
  reduction kernel spreads a row over more threads when there are fewer rows: on an H100 the sum of a
  row of 576 floats took other bits for 8 rows than for 1, and the audit records reductions too.
- Softmax, log-softmax, maxima and elementwise ops are invariant as they are: torch computes each row of a
  softmax alone, in an order set by the row's length, and a maximum is exact in any order.

`Kernels.invariant = False` swaps in the plain ops (one `F.linear`, one masked softmax): the same mathematics
with batch-dependent bits, for the negative control (tests show parity breaks without it) and to measure the cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .blocks import CPU_ATTENTION, CUDA_ATTENTION, AttentionTiles
from .batched import WIDTH, last_tile
from .precision import FLOAT32_COLUMNS, compute_dtype, onednn_linear, plain_linear, uses_onednn
from .proofs import held_short, opaque, opaque_op, proven_long, proven_short, proven_units

if TYPE_CHECKING:
    from .config import LlamaConfig


@dataclass(frozen=True)
class Tiles:
    """The fixed sizes every product is issued with. Both runs of a comparison must use the same ones.

    Changing them changes the bits (another kernel), never the parity. The defaults per device trade
    padding against the number of calls: a CPU multiplies a 64-row tile about as fast per row as a big
    matrix; a GPU wants fewer, bigger calls. The linear tile is this module's; attention's sizes are
    attention's own (blocks.AttentionTiles), carried here so that one object names every size a model uses.

    `short`: smaller row counts that may stand in for a pass's last linear tile, so that a pass of a few
    rows (one sequence decoding) does not pay for a whole tile. A short product is used for a weight only
    where this process has shown that it gives every row the bits the whole tile gives it (`proven_short`:
    on a CPU, oneDNN's and MKL's kernels add along K in the same order for any number of rows from 2 up; a
    GPU proves its own), so a short tile changes no bit: the answers are the whole tiles' wherever it is used
    or not.

    `long`: bigger row counts, whole numbers of tiles, that may stand in for as many whole tiles in a row:
    one product instead of several, used for a weight only where this process has shown that it gives every
    row the bits its own tile's product gives it (`proven_long`). A product of 512 rows runs 1.1-1.5x faster
    per row than 64-row ones on a CPU (one call, one parallel region); the bits are the tiles'.
    """

    rows: int = 64  # rows per linear-layer product
    attention: AttentionTiles = field(default_factory=AttentionTiles)
    short: tuple[int, ...] = ()  # rows of the products that may stand in for a pass's last tile
    long: tuple[int, ...] = ()  # rows (whole tiles) of the products that may stand in for a run of whole tiles

    def whole_only(self) -> "Tiles":
        """These sizes with no short or long tile, short batch, short or long item tile: every product and call
        whole, the bits a short or long one must give."""
        a = self.attention
        return replace(self, short=(), long=(), attention=replace(a, whole=replace(a.whole, short=(), short_rows=(),
                                                                                long_rows=()),
                                                        partial=replace(a.partial, short=(), short_rows=())))

    def unit(self, widths: tuple[int, ...]) -> int:
        """The rows a pass is padded to a multiple of, for elementwise tensors of these row widths: the
        smallest tile whose rows make every such tensor a multiple of 128 elements, or the whole tile. (A CPU's
        vector loops finish a tensor's last elements, and a thread's share, with scalar code of other bits;
        model.py.)"""
        return min([s for s in self.short if all(s * w % 128 == 0 for w in widths)] + [self.rows])

    def tile_end(self, n: int, short: tuple[int, ...] | None = None) -> int:
        """The rows a pass of n rows computes in its linear products: whole tiles, and the last tile
        (`last_tile`) of the rest, taking the `short` tiles as proven (all of them where None)."""
        whole, rest = divmod(n, self.rows)
        return whole * self.rows + last_tile(rest, self.rows, self.short if short is None else short)


CPU_TILES = Tiles(rows=64, attention=CPU_ATTENTION, short=(4, 8, 16, 32), long=(512, 256))
# A GPU: bigger row tiles (a 256-row product still reads each weight once per tile). Its short tiles are
# used only where the GPU proves them for the weight (cuBLAS may pick another kernel, and split K another
# way, for fewer rows: then the pass pays for the whole tile); without them a decode step of 64 questions
# computes 256 rows, and at Llama-3-8B's shape its products are bound by arithmetic, not by the weights' read.
CUDA_TILES = Tiles(rows=256, attention=CUDA_ATTENTION, short=(16, 32, 64, 128))


def default_tiles(device: torch.device) -> Tiles:
    return CUDA_TILES if device.type == "cuda" else CPU_TILES


class NoComm:
    """One process's collectives: every unit is here, so there is nothing to send. `TiledLinear` calls the
    same three methods on it as on a tensor-parallel rank's (distributed/tp.py), so one rule reads straight
    for one process and many."""

    size = 1
    bytes_moved = 0

    def all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def tree_sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        return tree_sum(partials)

    def gather_columns(self, out: torch.Tensor, total: int) -> torch.Tensor:
        return out


@dataclass
class Kernels:
    """The model-level switch that every module reads: invariant products or plain ones, and their tiles.

    One object per model, shared by its modules; `tiles=None` takes the device's default.
    """

    invariant: bool = True
    tiles: Tiles | None = None
    # Products issued per `units` fixed shards of whole KV-head groups (TiledLinear): 1 is one product per
    # tile; any tensor-parallel degree that divides `units` gives the bits of one process with these units.
    units: int = 1
    # The collectives: `NoComm` in one process, a tensor-parallel rank's (distributed/tp.py) in many.
    comm: Any = field(default_factory=NoComm)

    def tiles_for(self, device: torch.device) -> Tiles:
        return self.tiles or default_tiles(device)

    def row_unit(self, device: torch.device, config: LlamaConfig) -> int:
        """A pass's rows are padded to a multiple of this, or 1 with the plain kernels: `Tiles.unit` for the
        row widths of the model's elementwise tensors (hidden states, a RoPE half, an MLP unit's features)."""
        if not self.invariant:
            return 1
        widths = (config.hidden_size, max(config.head_dim // 2, 1),
                  *(b - a for a, b in unit_bounds(config.intermediate_size, self.units)))
        return self.tiles_for(device).unit(widths)

    def tile_end(self, n: int, device: torch.device, dtype: torch.dtype | None = None) -> int:
        """The rows a pass of n rows computes (`Tiles.tile_end`), n with the plain kernels: rows up to here
        cost nothing more. With the model's `dtype`, only the short tiles that this process's proofs hold for
        every weight so far (`proofs.held_short`): on a GPU that proves none, every pass computes whole tiles."""
        if not self.invariant:
            return n
        t = self.tiles_for(device)
        held = None if dtype is None else held_short(t.rows, t.short, compute_dtype(device, dtype), device)
        return t.tile_end(n, held)

    @property
    def sharded(self) -> bool:
        """Whether this process is one rank of a tensor-parallel group (its collectives are real)."""
        return not isinstance(self.comm, NoComm)

    @property
    def local(self) -> range:
        """The units this process holds: all of them in one process, a rank's own run in a group."""
        return self.comm.local if self.sharded else range(self.units)


def _whole_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, int]:
    """x (..., K) as rows (M_pad, K), zero rows appended up to a whole number of tiles, and M."""
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    m = rows.shape[0]
    pad = (-m) % tile
    return (F.pad(rows, (0, 0, 0, pad)) if pad else rows), m  # one launch (a GPU's pass of short tiles pads here)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int, short: tuple[int, ...] = (),
                 long: tuple[int, ...] = ()) -> torch.Tensor:
    """`x @ weight.T` for x (..., K) and weight (N, K), one fixed (tile, K) x (K, N) product per tile of rows.

    The product is a `torch.mm`, or on a CPU computing in float32 one oneDNN linear (`precision.cpu_gemm`:
    several times faster where oneDNN has AVX-512 kernels and the BLAS does not use them). A 16-bit model on a
    CPU without native 16-bit dot products computes in float32 (precision.py): each tile against each fixed
    slice of `FLOAT32_COLUMNS` weight columns, cast once per call. The rows past the last whole tile run as
    one product of the smallest `short` row count that holds them and that `proven_short` has shown gives
    the whole tile's bits for this slice, else as a whole tile; runs of whole tiles go as one product of the
    longest `long` row count that fits and that `proven_long` has shown gives each tile's bits, longest first.
    Under torch.compile it is one opaque op that runs this function as it is: Inductor would otherwise rewrite
    a product with its neighbours (a residual added after `mm` became one `addmm` for some row counts only).
    """
    if opaque():
        return _linear_op(x, weight, tile, list(short), list(long))
    *lead, k = x.shape
    n = weight.shape[0]
    calc = compute_dtype(x.device, x.dtype)
    width = FLOAT32_COLUMNS if calc != x.dtype else max(n, 1)  # native: one part, the weight itself

    # torch.mm gave a row of 2 to 11 output columns other bits at another row of its tile (a CPU: 5-7 or 9-11
    # for a weight stored column-major, o and down at hidden size 6; 2-11 for one stored row-major whose K is not
    # a multiple of 4, a unit's q at hidden size 5): a last part narrower than 2 * WIDTH is padded to 2 * WIDTH
    last = (n - 1) % width + 1  # the last part's columns
    narrow = 2 * WIDTH - last if n and last < 2 * WIDTH else 0  # zero columns on torch.mm's last part

    def part(a: int) -> torch.Tensor:  # (K, <= width): row-major when the weight is stored column-major
        p = _as(weight.t()[:, a:a + width], calc)
        return F.pad(p, (0, narrow)) if narrow and a + width >= n else p

    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):  # autograd: no out= products
        rows, m = _whole_tiles(x, tile)
        rows = rows.to(calc)
        parts = [part(a) for a in range(0, n, width)]
        out = torch.cat([torch.cat([torch.mm(rows[i:i + tile], p) for p in parts], dim=1)
                         for i in range(0, rows.shape[0], tile)])
        return out[:m, :n].to(x.dtype).reshape(*lead, n)
    onednn = uses_onednn(x.device, calc) and k > 0  # oneDNN refuses an empty sum (a unit of no features)
    pad = 0 if onednn else narrow  # the output's columns past N (oneDNN's rows kept their bits at every width)
    # A decode step makes ~200 calls of one short tile: each op skipped below (a reshape, a cast or a slice
    # that changes nothing) is a dispatch saved, ~1,000 a step.
    rows = _as(x if x.dim() == 2 else x.reshape(-1, k), calc)  # (M, K)
    m = rows.shape[0]
    whole, rest = divmod(m, tile)

    def products(p: torch.Tensor) -> list[tuple[int, int]]:  # (first row, rows) of each product, proofs when used
        last = last_tile(rest, tile, proven_short(p, tile, short, onednn)) if rest else 0
        runs = proven_long(p, tile, long, onednn) if long and whole * tile >= min(long) else ()
        return _products(whole, tile, runs, last)

    one = None  # the weight as the product takes it, where it is one slice (native): its products known now
    if n <= width:
        one = _as(weight, calc) if onednn else part(0)
        pieces = products(one)
        end = sum(size for _, size in pieces)
    else:  # slices: each one's last tile (its own proof) reads within whole tiles
        end = -(-m // tile) * tile
    if end > m:  # zero rows up to what the products read
        rows = F.pad(rows, (0, 0, 0, end - m))
    if one is not None and onednn and len(pieces) == 1:  # one product: its result is the output
        return _output(onednn_linear(rows, one), m, x.dtype, lead)
    out = rows.new_empty(end, n + pad)  # (rows read, N)
    for a in range(0, n, width):
        if one is None:  # one float32 slice at a time, in cache while every tile meets it; oneDNN takes (N, K)
            p = weight[a:a + width].to(calc) if onednn else part(a)
            pieces = products(p)
        else:
            p = one
        cols = slice(a, a + width if a + width < n else n + pad)  # the slice's output columns (the last may differ)
        for i, size in pieces:
            if onednn:
                out[i:i + size, cols] = onednn_linear(rows[i:i + size], p)
            else:
                torch.mm(rows[i:i + size], p, out=out[i:i + size, cols])
    return _output(out[:, :n].contiguous() if pad else out, m, x.dtype, lead)


def _linear(x: torch.Tensor, weight: torch.Tensor, tile: int, short: list[int], long: list[int]) -> torch.Tensor:
    return tiled_linear(x, weight, tile, tuple(short), tuple(long))


_linear_op = opaque_op("tiled_linear", _linear, lambda x, weight, *_: x.new_empty(*x.shape[:-1], weight.shape[0]))


def _products(whole: int, tile: int, runs: tuple[int, ...], last: int) -> list[tuple[int, int]]:
    """(first row, rows) of each product of a pass: its `whole` tiles in runs of the longest proven row
    counts that fit, the tiles left one by one, then its last tile of `last` rows (0: none)."""
    out: list[tuple[int, int]] = []
    i, end = 0, whole * tile
    for size in sorted(runs, reverse=True):
        while end - i >= size:
            out.append((i, size))
            i += size
    out += [(j, tile) for j in range(i, end, tile)]
    return out + ([(end, last)] if last else [])


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype, without a dispatch where it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _output(out: torch.Tensor, m: int, dtype: torch.dtype, lead: list[int]) -> torch.Tensor:
    """The product's first m rows (M_read, N) as (*lead, N) in dtype, each step only where it changes
    something."""
    out = _as(out if out.shape[0] == m else out[:m], dtype)
    return out if len(lead) == 1 else out.reshape(*lead, out.shape[-1])


def tiled_mean_square(x: torch.Tensor, tile: int) -> torch.Tensor:
    """mean(x ** 2) over the last dim, (..., 1), one fixed (tile, K) reduction per tile of rows.

    A reduction is issued with a fixed shape for the same reason a product is: a GPU's reduction kernel
    chooses how many threads share a row from the number of rows (on an H100 a row of 576 floats is summed
    in another order for 8 rows than for 1), so a row's bits would follow the size of the pass. Under
    torch.compile it is one opaque op, run as it is: Inductor would write a reduction of its own.
    """
    return _mean_square_op(x, tile) if opaque() else _mean_square(x, tile)


def _mean_square(x: torch.Tensor, tile: int) -> torch.Tensor:
    sq, m = _whole_tiles(x.pow(2), tile)  # (M_pad, K)
    out = sq.new_empty(sq.shape[0], 1)
    for i in range(0, sq.shape[0], tile):
        torch.mean(sq[i:i + tile], dim=-1, keepdim=True, out=out[i:i + tile])
    return out[:m].reshape(*x.shape[:-1], 1)


_mean_square_op = opaque_op("tiled_mean_square", _mean_square, lambda x, tile: x.new_empty(*x.shape[:-1], 1))


def unit_bounds(n: int, units: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `units` contiguous shards of n features; the first n % units are one larger."""
    bounds, at = [], 0
    for u in range(units):
        size = n // units + (u < n % units)
        bounds.append((at, at + size))
        at += size
    return bounds


# The fixed tree in which a row-split product's unit partials are added. Node (lo, hi) covers units
# lo .. hi-1 and is the sum of its halves, split at lo + (hi - lo) // 2:
#
#     units 8:  ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))      units 3:  p0 + (p1 + p2)
#
# The tree depends on the number of units only, so one process and every tensor-parallel degree perform the
# same IEEE additions in the same order (distributed/tp.py evaluates it across ranks).


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The partials of consecutive units added in the fixed tree."""
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def tree_nodes(lo: int, hi: int, run: range) -> list[tuple[int, int]]:
    """The largest nodes of the tree over units lo .. hi-1 that lie inside `run`, left to right."""
    if run.start <= lo and hi <= run.stop:
        return [(lo, hi)]
    if hi <= run.start or run.stop <= lo or hi - lo == 1:
        return []
    mid = lo + (hi - lo) // 2
    return tree_nodes(lo, mid, run) + tree_nodes(mid, hi, run)


def tree_eval(lo: int, hi: int, known: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
    """The tree's node (lo, hi) from nodes already summed (`known` covers every unit exactly once)."""
    if (lo, hi) in known:
        return known[(lo, hi)]
    mid = lo + (hi - lo) // 2
    return tree_eval(lo, mid, known) + tree_eval(mid, hi, known)


class TiledLinear(nn.Linear):
    """`nn.Linear` whose product is row-invariant: forward hooks, names and checkpoints are nn.Linear's.

    With `kernels.units = U > 1` the product is issued per *unit*, one of U fixed shards of the features
    (U divides the KV heads, so a unit is whole KV-head groups), and its signature is then the same however
    many processes share the layer:

        split "columns" (q, k, v, gate, up, LM head): output features in U shards, unit u's outputs
                        x @ W[u].T on its row-major block W[u], concatenated: the same operand whether a
                        process holds 1 unit or all of them. Where the process has shown that one product
                        over its units gives each unit exactly those bits (`proofs.proven_units`), it
                        issues that one product, in whatever layout the weight has (column-major on a CPU);
                        a CPU's LM head, row-major, runs its units' blocks as they lie, unproven.
        split "rows" (o, down): input features in U shards, partial u = x[:, u] @ W[:, u].T, the partials
                        added in the fixed tree (`tree_sum`). The weight is stored column-major, so W[:, u].T
                        is one contiguous block.

    A tensor-parallel rank (distributed/tp.py) keeps the weights of its units (`kernels.local`) and its
    `kernels.comm` finishes the tree across ranks and gathers the LM head's vocabulary shards; in one
    process `NoComm` adds the whole tree here and gathers nothing.
    """

    def __init__(self, in_features: int, out_features: int, kernels: Kernels | None = None, bias: bool = False, *,
                 split: str = "columns", gather: bool = False, **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        if split not in ("columns", "rows"):
            raise ValueError(f"split must be 'columns' or 'rows', got {split!r}")
        self.kernels = kernels if kernels is not None else Kernels()
        self.split = split
        self.gather = gather  # columns: every process needs every unit's outputs (the LM head's logits)
        self.total = out_features if split == "columns" else in_features  # the split dimension, unsharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., in_features) -> (..., out_features), or this process's units of them (q, k, v, gate, up)."""
        k = self.kernels
        if not k.invariant:  # the plain path: a row split's sum in the order the collective picks
            out = plain_linear(x, self.weight)
            out = k.comm.all_reduce(out) if self.split == "rows" else out
        else:
            t = k.tiles_for(x.device)
            if k.units == 1:
                out = tiled_linear(x, self.weight, t.rows, t.short, t.long)
            elif self.split == "rows":
                out = k.comm.tree_sum([tiled_linear(x[..., a:b].contiguous(), self.weight[:, a:b], t.rows, t.short,
                                                    t.long) for a, b in self.unit_bounds()])
            else:  # one product over the units where it gives each unit's bits, else each unit's row-major block
                def product(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                    return tiled_linear(r, w, t.rows, t.short, t.long)

                # A CPU's LM head, row-major, takes its units' own blocks as they lie: nothing to copy, and no
                # proof, which for SmolLM2's took ~2 s and ~370 MB at a process's first pass (docs/distributed.md).
                lm_head = self.gather and x.device.type == "cpu" and self.weight.is_contiguous()
                if not lm_head and proven_units(self.weight, self.unit_bounds(), (1, *t.short, t.rows, *t.long),
                                                  product):
                    out = product(x, self.weight)
                else:
                    out = torch.cat([product(x, self.weight[a:b].contiguous()) for a, b in self.unit_bounds()], dim=-1)
        out = self._add_bias(out)  # a row split's whole bias after the sum, a column split's own features' before
        return k.comm.gather_columns(out, self.total) if self.gather else out

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        """out + bias, after the product: one IEEE addition per element of whole rows, so row-invariant
        (a fused addmm would tie the bias into the product's kernel and its signature)."""
        return out if self.bias is None else out + self.bias

    def unit_bounds(self) -> list[tuple[int, int]]:
        """Where each of this process's units sits along the split dimension of its (local) weight."""
        bounds = unit_bounds(self.total, self.kernels.units)
        local = self.kernels.local
        first = bounds[local.start][0]
        return [(bounds[u][0] - first, bounds[u][1] - first) for u in local]


def linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool = True, tile: int | None = None) -> torch.Tensor:
    """A function form of `TiledLinear` for code that holds a bare weight (the tile: the device's default)."""
    if not invariant:
        return plain_linear(x, weight)
    t = default_tiles(x.device)
    return tiled_linear(x, weight, tile or t.rows, () if tile else t.short, () if tile else t.long)

