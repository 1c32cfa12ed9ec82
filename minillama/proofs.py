"""Proofs that a linear product of other row counts gives each row a tile's bits (invariant.tiled_linear).

A product's signature fixes its kernel, and so each row's bits (invariant.py). Two exceptions save work
where the process has first shown, on random rows, that they change no bit: a pass's last tile may run as a
short product of fewer rows (`proven_short`), a run of whole tiles as one long product (`proven_long`),
and a column-split projection's units as one product over all of them (`proven_units`).
Each proof runs once per process, weight-slice shape, thread count and library, when first needed: on a CPU
in float32 (a 16-bit model computes its CPU products in float32, precision.py); on a GPU in any dtype
(`provable`). A 16-bit product rounds its float32 sums to 8 or 11 bits, which hides
another order of additions from random rows in all but a few elements, so a 16-bit proof also tries
*cancelling* rows (`cancelling`), which show it in most. Attention's short batches and item tiles have their
own proofs (batched.py).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .precision import compute_dtype, onednn_linear, uses_onednn


class Proof(NamedTuple):
    """What one proof was asked, its record's key: the products of one operand, on one kind of device (a CPU's
    proof does not stand for a GPU's) and thread count, each proof from its own `kind`."""
    kind: str  # "short", "long" or "units"
    shape: tuple[int, ...]  # the operand's shape and layout
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str  # the device's kind
    threads: int
    tile: int  # the tile's rows (0 for units)
    sizes: tuple[int, ...]  # the row counts asked about
    how: Any  # whether oneDNN runs the product (short, long); the units' bounds and that (units)


_PROVEN: dict[Proof, Any] = {}


def proven_short(p: torch.Tensor, tile: int, short: tuple[int, ...], onednn: bool) -> tuple[int, ...]:
    """The row counts in `short` whose products with this weight slice give each row exactly the bits a
    (tile, K) product gives it, shown once per process, slice shape and thread count on a tile of random
    rows (every output element is a sum of K terms in the kernel's order, so another order shows in its last
    bits), where `provable`. A 16-bit product rounds its float32 sums to 8 or 11 bits, which hides another
    order in all but a few elements of random rows' products (in bfloat16 on a CPU, 3 of 4,800 short products
    differed on slices a random-rows proof passed), so in 16 bits the proof also takes cancelling rows
    (`cancelling`), whose products show it. `p` is what the product takes: (N, K) for oneDNN's linear, (K, N)
    for `torch.mm`."""
    if not short or not provable(p.dtype, p.device):  # whole tiles: the same bits
        return ()
    key = Proof("short", tuple(p.shape), p.stride(), p.dtype, p.device.type, torch.get_num_threads(), tile, short,
                onednn)
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            tried = [(x, q, _product(x, q, onednn)) for x, q in _operands(p, tile, onednn)]
            _PROVEN[key] = tuple(s for s in short if s < tile and all(
                same_rows(x, q, s, onednn, full) for x, q, full in tried))
    return _PROVEN[key]


def held_short(tile: int, short: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The sizes in `short` that no short-tile proof this process has made for products of `tile` rows in
    `dtype` on `device`'s kind refused (every one of them before the first): the last tile a pass's products
    take, for all of its weights, as far as the process knows (`Llama.rows_end`)."""
    held = set(short)
    for key, sizes in list(_PROVEN.items()):  # a copy: another thread may add a proof meanwhile
        if key.kind == "short" and key.dtype == dtype and key.tile == tile and key.device == device.type:
            held -= set(key.sizes) - set(sizes)  # the sizes it was asked about and refused
    return tuple(s for s in short if s in held)


def same_rows(x: torch.Tensor, p: torch.Tensor, s: int, onednn: bool = False, full: torch.Tensor | None = None
              ) -> bool:
    """Whether every s-row slice of the rows x, as a product of its own with p, gives exactly the rows of x's
    one product (`full`, made here when not given): `proven_short`'s question, asked of one operand."""
    full = _product(x, p, onednn) if full is None else full
    return all(torch.equal(_product(x[i:i + s].clone(), p, onednn), full[i:i + s])
               for i in range(0, x.shape[0] - s + 1, s))


def proven_long(p: torch.Tensor, tile: int, long: tuple[int, ...], onednn: bool) -> tuple[int, ...]:
    """The row counts in `long` (whole numbers of tiles) whose one product with this weight slice gives each
    row exactly the bits its own (tile, K) product gives it, shown as `proven_short` shows a short tile's: once
    per process, slice shape, thread count and library, on random rows (and cancelling ones in 16 bits),
    where `provable`."""
    if not long or not provable(p.dtype, p.device):
        return ()
    key = Proof("long", tuple(p.shape), p.stride(), p.dtype, p.device.type, torch.get_num_threads(), tile, long,
                onednn)
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            longest = max(long)
            tried = [(x, q, torch.cat([_product(x[i:i + tile].clone(), q, onednn) for i in range(0, x.shape[0], tile)]))
                     for x, q in _operands(p, longest - longest % tile, onednn)]
            _PROVEN[key] = tuple(s for s in long if s > tile and s % tile == 0 and all(
                torch.equal(_product(x[i:i + s].clone(), q, onednn), tiles[i:i + s])
                for x, q, tiles in tried for i in range(0, x.shape[0] - s + 1, s)))
    return _PROVEN[key]


def proven_units(weight: torch.Tensor, bounds: list[tuple[int, int]], rows: tuple[int, ...],
                 product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether one product over a column-split weight (N, K), as it is laid out, gives each unit's output
    features [a, b) exactly the bits of the unit's own product on its row-major block `weight[a:b]`
    (invariant.TiledLinear), at each row count in `rows` (one row, the short tiles, a tile, the longest run:
    every kind of product a pass issues), shown once per process, weight shape and layout, units and thread
    count, on random rows (and cancelling ones in 16 bits), only where `provable`. `product(x, w)` is the
    tiled product."""
    if not provable(weight.dtype, weight.device):
        return False
    if len(bounds) == 1 and weight.is_contiguous():  # the unit's own product, on its own block
        return True
    library = uses_onednn(weight.device, compute_dtype(weight.device, weight.dtype))  # a proof stands for its own
    key = Proof("units", tuple(weight.shape), weight.stride(), weight.dtype, weight.device.type,
                torch.get_num_threads(), 0, rows, (tuple(bounds), library))
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            _PROVEN[key] = all(torch.equal(product(x[:m], w),
                                           torch.cat([product(x[:m], w[a:b].contiguous()) for a, b in bounds], dim=-1))
                               for x, w in _operands(weight, max(rows), onednn=True) for m in sorted(set(rows)))
    return bool(_PROVEN[key])


OPAQUE = True  # `opaque`'s switch: the tests' negative control turns it off


def opaque() -> bool:
    """Whether the fixed-signature products and order-dependent reductions go as opaque ops, run as they are:
    under torch.compile, whose Inductor would otherwise fuse them with their neighbours and rewrite them
    (their bits would then follow the size of the pass)."""
    return OPAQUE and torch.compiler.is_compiling()


def opaque_op(name: str, fn: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor]) -> Callable:
    """`fn` (type-annotated) as the op minillama::name, which torch.compile calls as it is; `fake` gives the
    shape and dtype of its output from its inputs' (a new tensor, never a view of an input)."""
    op = torch.library.custom_op(f"minillama::{name}", fn, mutates_args=())
    op.register_fake(fake)
    return op


def provable(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a proof can stand for products of this dtype on this device (here, and attention's in
    batched.py), outside `torch.compile` (which takes whole tiles and calls): on a CPU in float32 (a 16-bit
    model's CPU products are float32, precision.py); on a CUDA device in any floating dtype (attention's
    products are float32 or wider). A linear product's proof runs in the first step that meets a weight's
    shape, which a GPU runs eagerly (step.py); attention's run in the host half, before its step. Either
    way a captured step replays a step whose proofs were made, and reads nothing back."""
    if torch.compiler.is_compiling():
        return False
    if device.type == "cpu":
        return dtype == torch.float32
    return device.type == "cuda" and dtype.is_floating_point


BIG = 2.0 ** 14  # a cancelling term: its float32 ulp (2^-9) is a good part of the other terms (~2^-8)


def cancelling(x: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of rows x (M, K) and of an operand p (K, N), in p's layout, whose products show another order of
    additions through a 16-bit product's rounding: p's values small (~2^-8), and every output's sum holding
    a +BIG and a -BIG term at two of 32 positions along K where every row is 1. The exact sum is the small
    terms', but a float32 partial sum that holds BIG rounds each small term added to it, so another order
    or grouping along K (another kernel, a split of K) moves the result by many of its 16-bit steps: on a
    CPU, an emulated split-K changed 45-92% of the elements of cancelling rows' bfloat16 products and
    0.006-0.02% of random rows' (four weight shapes; tests/test_invariant.py holds one). Values never choose
    a kernel; shapes and layouts do."""
    k, n = p.shape
    g = torch.Generator().manual_seed(0)
    where = torch.linspace(0, k - 1, min(32, k)).long()
    pick = torch.rand(n, len(where), generator=g).argsort(dim=1)[:, :2]  # (N, 2) of the 32 positions
    x, q = x.clone(), p.clone()  # a dense operand's copy keeps its strides
    values = torch.Generator(device=q.device).manual_seed(0)  # drawn where they go (an LM head's are many)
    q.copy_(torch.randn(k, n, generator=values, device=q.device, dtype=torch.float32).mul_(2.0 ** -8))
    x[:, where.to(x.device)] = 1.0
    q[where.to(q.device), :] = 0.0
    cols = torch.arange(n, device=q.device)
    q[where[pick[:, 0]].to(q.device), cols] = BIG
    if len(where) > 1:
        q[where[pick[:, 1]].to(q.device), cols] = -BIG
    return x, q


def _operands(p: torch.Tensor, rows: int, onednn: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (rows, operand) pairs a proof of products with `p` tries: random rows with p itself; in a 16-bit
    dtype, cancelling rows and operand too (`cancelling`)."""
    x = _random_rows(p, rows, onednn)
    if p.dtype not in (torch.float16, torch.bfloat16):
        return [(x, p)]
    xc, q = cancelling(x, p.t() if onednn else p)
    return [(x, p), (xc, q.t() if onednn else q)]


def _random_rows(p: torch.Tensor, rows: int, onednn: bool) -> torch.Tensor:
    """Random rows (rows, K) for a proof of products with `p` ((N, K) for oneDNN's linear, else (K, N))."""
    k = p.shape[1] if onednn else p.shape[0]
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(device=p.device, dtype=p.dtype)


def _product(r: torch.Tensor, p: torch.Tensor, onednn: bool) -> torch.Tensor:
    return onednn_linear(r, p) if onednn else torch.mm(r, p)


def unwatched():
    """Run outside any dispatch mode (audit.py's watchers): the proof's products are not the model's."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
