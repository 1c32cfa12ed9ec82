"""Attention's batched calls: `bmm` products and softmax sums issued in calls of a fixed item count.

The item count of a call is part of its signature (a backend may pick another kernel for another count), so
it is the kind's batch (blocks.ItemTiles.batch), never the size of the pass; a pass's last call may be a
short batch only where this process has shown that it gives every item the whole batch's bits
(`proven_batches`). attention.py issues the calls; plan.py pads a pass's items to what they take.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from .blocks import KEY_BLOCK, ItemTiles
from .precision import onednn_linear, uses_onednn
from .proofs import opaque, opaque_op, provable, unwatched


# Products are issued in whole multiples of WIDTH columns: a ragged output (a head size of 6 or 10 in the
# values product) is padded with zero columns, cut off after. A CPU's bmm gave a row of 5, 6, 7, 9, 10 or 11
# columns other bits at another row of its tile (parallel != independent at head size 6); padded to a
# multiple of 8, every row of 1 to 40 columns had its own bits. Real models' head sizes are never padded.
WIDTH = 8


def batched_products(a: torch.Tensor, b: torch.Tensor, batch: int) -> torch.Tensor:
    """out[i] = a[i] @ b[i] for I items, issued as `bmm` calls of exactly `batch` items each.

    a: (I, T, K), b: (I, K, N), I a multiple of `batch` (the plan pads with dummy items) but for a short last
    batch the plan chose where proven (`proven_batches`). Returns (I, T, N), computed N padded to a multiple
    of `WIDTH`. The batch count is part of a product's signature: a backend may pick another kernel for
    another count (cuBLAS does for a batch of one), so it never follows the size of the pass. Under
    torch.compile the calls are one opaque op, which Inductor runs as it is rather than rewrite with its
    neighbours.
    """
    n = b.shape[2]
    if n % WIDTH:
        return batched_products(a, torch.nn.functional.pad(b, (0, -n % WIDTH)), batch)[..., :n].contiguous()
    return _products_op(a, b, batch) if opaque() else _products(a, b, batch)


def _products(a: torch.Tensor, b: torch.Tensor, batch: int) -> torch.Tensor:
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for start in range(0, a.shape[0], batch):
        torch.bmm(a[start:start + batch], b[start:start + batch], out=out[start:start + batch])
    return out


_products_op = opaque_op("batched_products", _products,
                         lambda a, b, batch: a.new_empty(a.shape[0], a.shape[1], b.shape[2]))


def batched_row_sums(e: torch.Tensor, batch: int) -> torch.Tensor:
    """e.sum(-1, keepdim=True) for e (I, T, B), issued as sums over exactly `batch` items each.

    A reduction's kernel, like a product's, may follow the shape it is given (a GPU's splits a row across
    more threads when there are fewer rows), so it too never sees the size of the pass. Under torch.compile
    it is one opaque op, run as it is: Inductor would write a reduction of its own.
    """
    return _row_sums_op(e, batch) if opaque() else _row_sums(e, batch)


def _row_sums(e: torch.Tensor, batch: int) -> torch.Tensor:
    out = e.new_empty(e.shape[0], e.shape[1], 1)
    for start in range(0, e.shape[0], batch):
        torch.sum(e[start:start + batch], dim=-1, keepdim=True, out=out[start:start + batch])
    return out


_row_sums_op = opaque_op("batched_row_sums", _row_sums, lambda e, batch: e.new_empty(e.shape[0], e.shape[1], 1))


def run_scores(q: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """(n, T, B) scores of a run's query tiles q (n, T, D) against its one key block (B, D): one oneDNN product
    of all n * T rows (`ItemTiles.runs`)."""
    return onednn_linear(q.reshape(-1, q.shape[2]), block).view(q.shape[0], q.shape[1], block.shape[0])


def run_values(e: torch.Tensor, block_t: torch.Tensor) -> torch.Tensor:
    """(n, T, D) a run's weights e (n, T, B) times its one value block, given transposed (D, B) and contiguous
    (oneDNN's weight layout): one oneDNN product."""
    d = block_t.shape[0]
    if d % WIDTH:  # as batched_products pads its columns
        return run_values(e, torch.nn.functional.pad(block_t, (0, 0, 0, -d % WIDTH)))[..., :d].contiguous()
    return onednn_linear(e.reshape(-1, e.shape[2]), block_t).view(e.shape[0], e.shape[1], d)


def run_row_sums(e: torch.Tensor) -> torch.Tensor:
    """e.sum(-1, keepdim=True) of a run's weights e (n, T, B), in one call."""
    return e.sum(dim=-1, keepdim=True)


class ItemProof(NamedTuple):
    """What one proof of attention's calls was asked, its record's key: on one kind of device (a CPU's proof does
    not stand for a GPU's) and thread count, each proof from its own `kind`."""
    kind: str  # "run", "batches", "rows" or "scan"
    tiles: ItemTiles | None  # the kind of item (None: a scan)
    shape: tuple[int, ...]  # the head size D (a scan: its terms' (rows, J, D + 1)); a run's length n after it
    dtype: torch.dtype
    device: str  # the device's kind
    threads: int


_PROVEN: dict[ItemProof, Any] = {}


def proven_run(kind: ItemTiles, d: int, n: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether n items of the kind that meet one key block, taken as a run (`run_scores`, `run_values`,
    `run_row_sums`), give every item exactly the bits its whole batch's calls give it, shown once per process,
    kind, head size, n and thread count on random items; only where `provable` and oneDNN runs the products."""
    if not kind.runs or not provable(dtype, device) or not uses_onednn(device, dtype):
        return False
    key = ItemProof("run", kind, (d, n), dtype, device.type, torch.get_num_threads())
    if key not in _PROVEN:
        whole = -(-n // kind.batch) * kind.batch  # the run's items and the rest of their last batch
        g = torch.Generator().manual_seed(n)
        q, e = torch.randn(whole, kind.rows, d, generator=g), torch.rand(whole, kind.rows, KEY_BLOCK, generator=g)
        k, v = torch.randn(KEY_BLOCK, d, generator=g), torch.randn(KEY_BLOCK, d, generator=g)
        with unwatched(), torch.no_grad():
            batches = _calls(q, k.expand(whole, -1, -1).contiguous(), v.expand(whole, -1, -1).contiguous(), e,
                             kind.batch)
            run = run_scores(q[:n], k), run_values(e[:n], v.t().contiguous()), run_row_sums(e[:n])
            _PROVEN[key] = (1,) if all(torch.equal(r, full[:n]) for r, full in zip(run, batches)) else ()
    return bool(_PROVEN[key])


def sums_in_order(ordered: torch.Tensor) -> torch.Tensor:
    """(rows, D + 1) each row's J terms of `ordered` (rows, J, D + 1) added in order onto +0, J additions of
    every row at once (attention's row order)."""
    sums = ordered[:, 0] + 0.0  # +0 + t is t + +0 (IEEE addition commutes): the first addition, one launch
    for j in range(1, ordered.shape[1]):
        sums = sums + ordered[:, j]
    return sums


def scan_sums(ordered: torch.Tensor) -> torch.Tensor:
    """(rows, D + 1) each row's J terms of `ordered` (rows, J, D + 1) added in order as one scan, +0 after
    (a scan that starts from its first term rather than from +0 keeps a -0 that the additions would not)."""
    return ordered.cumsum(dim=1)[:, -1] + 0.0


def proven_scan(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether one `cumsum` over the terms of `ordered` (rows, J, D + 1), plus +0, gives each row's last sum
    exactly the bits of J additions in order onto +0 (`attention._add_in_row_order`), shown once per process,
    device, dtype, J and D (`scan_matches`). Never on a CPU, whose `cumsum` adds float32 in double; on a GPU
    the proof runs in the host half, before any step of that shape."""
    if device.type == "cpu" or torch.compiler.is_compiling():
        return False
    shape = (min(shape[0], 8192), shape[1], shape[2])  # the scan runs each row alone, in order
    key = ItemProof("scan", None, shape, dtype, device.type, 0)
    if key not in _PROVEN:
        _PROVEN[key] = (1,) if scan_matches(shape, dtype, device) else ()
    return bool(_PROVEN[key])


def scan_matches(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> bool:
    """`scan_sums` against `sums_in_order`, bit for bit and sign for sign, on random terms of `shape` with
    zeros and -0 among them."""
    g = torch.Generator(device=device).manual_seed(shape[1])
    x = torch.randn(shape, generator=g, device=device) * torch.rand(shape, generator=g, device=device) ** 8 * 1e3
    x[::3, ::2] = 0.0
    x[1::3, ::3] = -0.0
    x = x.to(dtype)
    with unwatched(), torch.no_grad():
        loop, scan = sums_in_order(x), scan_sums(x)
        return torch.equal(loop, scan) and torch.equal(loop.signbit(), scan.signbit())


def _items(kind: ItemTiles, d: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A whole batch of random items of the kind, in the attention's dtype on its device: q (n, T, D), k and v
    (n, B, D), e (n, T, B) in exp's range."""
    n, t, b = kind.batch, kind.rows, KEY_BLOCK
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, rows, d, generator=g) for rows in (t, b, b))
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v, torch.rand(n, t, b, generator=g)))


def _calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The kind's three calls, in calls of n items: the scores' and the values' `bmm`, the softmax's sums."""
    return batched_products(q, k.transpose(1, 2), n), batched_products(e, v, n), batched_row_sums(e, n)


def proven_batches(kind: ItemTiles, d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The item counts in `kind.short` whose calls give each item exactly the bits a call of a whole batch
    gives it, shown once per process, device, kind, head size and thread count on random items, a short call
    placed as a pass's last batch is (after a whole one), where `provable`. On a GPU, as a CPU, the proof runs
    in the host half (plan.py), before any step that takes a short batch: never inside a captured step."""
    if not kind.short or not provable(dtype, device):
        return ()
    key = ItemProof("batches", kind, (d,), dtype, device.type, torch.get_num_threads())
    if key not in _PROVEN:
        n = kind.batch
        items = _items(kind, d, dtype, device)

        def same(s: int, i: int) -> bool:
            """Items i .. i + s - 1, called alone after a whole batch, against the whole batch's call."""
            calls = _calls(*(torch.cat([x, x[i:i + s]]) for x in items), n)
            return all(torch.equal(out[n:], out[i:i + s]) for out in calls)

        with unwatched(), torch.no_grad():
            _PROVEN[key] = tuple(s for s in kind.short if s < n and all(same(s, i) for i in range(0, n - s + 1, s)))
    return _PROVEN[key]


def proven_rows(kind: ItemTiles, d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The tile sizes in `kind.short_rows` whose items, in whole batches, give each row exactly the bits a
    tile of `kind.rows` rows gives it, every slice of a whole tile tried, shown once per process, device,
    kind, head size and thread count, where `provable` (in the host half, as `proven_batches`). (A short
    batch of such tiles is proven on its own: `proven_batches` of the kind with that many rows.)"""
    if not kind.short_rows or not provable(dtype, device):
        return ()
    key = ItemProof("rows", kind, (d,), dtype, device.type, torch.get_num_threads())
    if key not in _PROVEN:
        n = kind.batch
        q, k, v, e = _items(kind, d, dtype, device)
        whole = _calls(q, k, v, e, n)

        def same(t: int, r: int) -> bool:
            """Rows r .. r + t - 1 of every item as tiles of their own, against the whole tiles' rows."""
            calls = _calls(q[:, r:r + t].contiguous(), k, v, e[:, r:r + t].contiguous(), n)
            return all(torch.equal(out, full[:, r:r + t]) for out, full in zip(calls, whole))

        with unwatched(), torch.no_grad():
            _PROVEN[key] = tuple(t for t in kind.short_rows if t < kind.rows
                                 and all(same(t, r) for r in range(0, kind.rows - t + 1, t)))
    return _PROVEN[key]


def last_tile(rest: int, tile: int, short: tuple[int, ...]) -> int:
    """The rows of the product that holds a pass's `rest` rows past its whole tiles (or the items of the call
    that holds its `rest` items past its whole batches): the smallest of the `short` sizes that holds them,
    else a whole tile; 0 when none is left."""
    return min([s for s in short if s >= rest] + [tile]) if rest else 0


def batch_items(kind: ItemTiles, d: int, count: int, dtype: torch.dtype, device: torch.device) -> int:
    """The items `count` items of a kind take in its calls: whole batches, the last one short where proven
    (`proven_batches`)."""
    whole, rest = divmod(count, kind.batch)
    return whole * kind.batch + last_tile(rest, kind.batch, proven_batches(kind, d, dtype, device) if rest else ())


def long_tile(kind: ItemTiles, d: int, group_rows: list[int], heads: int, dtype: torch.dtype,
              device: torch.device) -> ItemTiles:
    """The kind a pass whose groups hold `group_rows` rows (in each of `heads` KV heads) lays its items out in:
    where no group is long enough for a run (`kind.runs` tiles) and tiles of `kind.rows` take more than one call
    (a long tile saves calls and gathers, not arithmetic), in the largest of `kind.long_rows` whose items, padded
    to the calls they take (`batch_items`), hold at most 1/8 more rows than tiles of `kind.rows` do, and whose
    every slice of `kind.rows` rows gives each row exactly the bits of a tile of its own (`proven_rows` of the
    bigger tile); else as it is. A long tile whose rows alone, before any padding to calls, hold more than that is
    passed over unproven. So a small pass (the first of a few questions) makes no long tile's proofs, which took
    ~0.4 s of a process's first pass; the answers are the tiles of `kind.rows`' either way."""
    def padded(k: ItemTiles) -> int:  # rows computed: tiles, padded to whole batches
        return batch_items(k, d, heads * sum(-(-n // k.rows) for n in group_rows), dtype, device) * k.rows

    if kind.runs and max(group_rows) >= kind.runs * kind.rows:
        return kind
    rows = padded(kind)
    if rows <= kind.batch * kind.rows:  # one call of tiles of `kind.rows`: no long tile would save one
        return kind
    for t in sorted(kind.long_rows, reverse=True):
        # No layout in tiles of t computes fewer rows than its tiles: where they alone hold too many, no proof.
        if heads * sum(-(-n // t) for n in group_rows) * t * 8 > rows * 9:
            continue
        long = replace(kind, rows=t, short_rows=(kind.rows,), long_rows=())
        if kind.rows in proven_rows(long, d, dtype, device) and padded(replace(long, short_rows=())) * 8 <= rows * 9:
            return replace(long, short_rows=())
    return kind
