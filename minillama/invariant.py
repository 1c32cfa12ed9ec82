"""Batch-invariant primitives: a row's result never depends on what else is in the batch.

A BLAS picks its kernel, blocking and thread split from the matrix shape, so row i of `X @ W.T` can change
in the last bits when X gains or loses rows (measured in NOTES.md: 28 of 49 fp32 cases differ). We pad the
rows to a multiple of ROW_TILE and multiply one tile at a time, every call the same (ROW_TILE, K) x (K, N)
product: the kernel, its thread split, and so every row's reduction order, are then fixed whatever the
number of rows. (One `bmm` over all tiles is not enough: with 2 threads, MKL splits a lone tile's K = 1536
product differently from a batch of two or more, and the bits move.)

Row-wise ops (RMSNorm, softmax, log-softmax, elementwise) are invariant as they are.

Every function takes `invariant`; with `invariant=False` it runs the plain op. That switch exists for the
negative control (tests show parity breaks without it) and for measuring what invariance costs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# 64 rows: prefill and a 64-question decode step run as fast as a plain matmul; one-row decoding (the
# independent reference run) pays for the padding. Changing it changes the bits, never the parity.
ROW_TILE = 64


def linear(x: torch.Tensor, weight: torch.Tensor, invariant: bool = True) -> torch.Tensor:
    """`x @ weight.T` for x of shape (..., K) and weight (N, K), row-invariant when `invariant`."""
    if not invariant:
        return F.linear(x, weight)
    *lead, k = x.shape
    n = weight.shape[0]
    rows = x.reshape(-1, k)  # (M, K)
    m = rows.shape[0]
    pad = (-m) % ROW_TILE
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    out = rows.new_empty(rows.shape[0], n)  # (M_pad, N)
    w = weight.t()
    for i in range(0, rows.shape[0], ROW_TILE):
        torch.mm(rows[i:i + ROW_TILE], w, out=out[i:i + ROW_TILE])
    return out[:m].reshape(*lead, n)
