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

- Linear layers pad their rows to whole tiles of `Tiles.rows` and run one (rows, K) x (K, N) `mm` per tile.
  (One `bmm` over all tiles is not enough: its batch count follows the number of tiles, and with 2 threads
  MKL splits a lone tile's product differently from a batch of them.)
- Attention (attention.py) runs its (query tile, key block) products in `bmm` calls of a fixed batch count.
- Row-wise ops (RMSNorm, softmax, log-softmax) and elementwise ops are invariant as they are, given the
  model's padding to whole row tiles (model.py says why).

`Kernels.invariant = False` swaps in the plain ops (one `F.linear`, one masked softmax): the same
mathematics with batch-dependent bits. That switch exists for the negative control (tests show parity breaks
without it) and for measuring what invariance costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class Tiles:
    """The fixed sizes every product is issued with. Both runs of a comparison must use the same ones.

    Changing them changes the bits (another kernel), never the parity. The defaults per device trade
    padding against the number of calls: a CPU multiplies a 64-row tile about as fast per row as a big
    matrix; a GPU wants fewer, bigger calls.
    """

    rows: int = 64  # rows per linear-layer product
    full: int = 64  # query rows per tile against a whole key block
    part: int = 8  # query rows per tile against a query's own, partly visible block
    full_batch: int = 32  # (tile, block) items per bmm, whole blocks
    part_batch: int = 256  # (tile, block) items per bmm, partial blocks
    # Most items whose scores are held at once (a multiple of the batch): a longer pass computes its
    # scores twice (once for the row maxima, once for the values) rather than hold them all. On a CPU,
    # small chunks win: a chunk's gathered tiles, keys and scores (~4 MiB) stay in cache, where fresh
    # multi-megabyte temporaries cost page faults and memory traffic (measured: a 2,048-token prefill's
    # attention 2-3x faster with chunks of 64-128 items than of 4,096, recomputation included).
    full_chunk: int = 128
    part_chunk: int = 512
    # A kind with at most this many items in a pass keeps its scores (one chunk, nothing recomputed),
    # whatever the chunk size: a decode step over a long document (576 whole items at 4,096 tokens) is
    # ~25% faster in one chunk, while a prefill's tens of thousands of items still go in small chunks.
    keep: int = 0
    # How a block's terms are added to its rows (attention._add_rows): one `index_add_` (one launch), or a
    # gather, an add and an `index_put_` (a CPU's choice: its index_add_ is ~1000x slower with 2 threads).
    # The same IEEE additions either way: the bits do not depend on it.
    index_add: bool = False

    def __post_init__(self) -> None:
        if self.full_chunk % self.full_batch or self.part_chunk % self.part_batch:
            raise ValueError("chunks must hold whole batches")


# A CPU: the masked own-block items in bmm calls of 64 rather than 256 (prefill attention ~20% faster at the
# paper's layout, decode ~10%: the 8-row tiles' scores and keys stay in cache through each call).
CPU_TILES = Tiles(part_batch=64, keep=640)
# Untuned on a GPU so far: bigger row tiles (a 256-row product still reads each weight once per tile),
# batches and chunks big enough that a pass issues few launches (tests/test_signatures.py counts them).
CUDA_TILES = Tiles(rows=256, full_batch=256, part_batch=1024, full_chunk=8192, part_chunk=16384, index_add=True)


def default_tiles(device: torch.device) -> Tiles:
    return CUDA_TILES if device.type == "cuda" else CPU_TILES


@dataclass
class Kernels:
    """The model-level switch that every module reads: invariant products or plain ones, and their tiles.

    One object per model, shared by its modules; `tiles=None` takes the device's default.
    """

    invariant: bool = True
    tiles: Tiles | None = None

    def tiles_for(self, device: torch.device) -> Tiles:
        return self.tiles or default_tiles(device)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """`x @ weight.T` for x (..., K) and weight (N, K), one fixed (tile, K) x (K, N) `mm` per tile of rows."""
    *lead, k = x.shape
    n = weight.shape[0]
    rows = x.reshape(-1, k)  # (M, K)
    m = rows.shape[0]
    pad = (-m) % tile
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    w = weight.t()  # (K, N): row-major when the weight is stored column-major (Llama.column_major_)
    if torch.is_grad_enabled() and (w.requires_grad or rows.requires_grad):  # autograd: no out= products
        out = torch.cat([torch.mm(rows[i:i + tile], w) for i in range(0, rows.shape[0], tile)])
    else:
        out = rows.new_empty(rows.shape[0], n)  # (M_pad, N)
        for i in range(0, rows.shape[0], tile):
            torch.mm(rows[i:i + tile], w, out=out[i:i + tile])
    return out[:m].reshape(*lead, n)


class TiledLinear(nn.Linear):
    """`nn.Linear` whose product is row-invariant: forward hooks, names and checkpoints are nn.Linear's."""

    def __init__(self, in_features: int, out_features: int, kernels: Kernels | None = None, bias: bool = False,
                 **kw):
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.kernels = kernels if kernels is not None else Kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.kernels.invariant:
            return self._add_bias(F.linear(x, self.weight))
        return self._add_bias(tiled_linear(x, self.weight, self.kernels.tiles_for(x.device).rows))

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        """out + bias, after the product: one IEEE addition per element of whole rows, so row-invariant
        (a fused addmm would tie the bias into the product's kernel and its signature)."""
        return out if self.bias is None else out + self.bias


def linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool = True, tile: int | None = None) -> torch.Tensor:
    """A function form of `TiledLinear` for code that holds a bare weight (the tile: the device's default)."""
    if not invariant:
        return F.linear(x, weight)
    return tiled_linear(x, weight, tile or default_tiles(x.device).rows)

