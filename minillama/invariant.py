"""Batch-invariant primitives: a row's result never depends on what else is in the batch.

A BLAS picks its kernel, blocking and thread split from the matrix shape, so row i of `X @ W.T` can change
in the last bits when X gains or loses rows (measured in NOTES.md: 28 of 49 fp32 cases differ). We pad the
rows to a multiple of ROW_TILE and run one `bmm` whose every batch entry has the same (ROW_TILE, K) x (K, N)
shape: the kernel, and so every row's reduction order, is then fixed whatever the number of rows.
(`torch.matmul` on a 3-D input folds it back into one 2-D product, so it must be `bmm`.)

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
    tiles = rows.view(-1, ROW_TILE, k)  # (M_pad / T, T, K)
    w = weight.t().unsqueeze(0).expand(tiles.shape[0], k, n)  # a view: the weight is not copied
    out = torch.bmm(tiles, w).view(-1, n)[:m]  # (M, N)
    return out.reshape(*lead, n)
