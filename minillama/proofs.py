"""Proofs that a linear product of other row counts gives each row a tile's bits (invariant.tiled_linear).

A product's signature fixes its kernel, and so each row's bits (invariant.py). Two exceptions save work
where the process has first shown, on random rows, that they change no bit: a pass's last tile may run as a
short product of fewer rows (`proven_short`), a run of whole tiles as one long product (`proven_long`),
and a column-split projection's units as one product over all of them (`proven_units`).
Each proof runs once per process, weight-slice shape, thread count and library, when first needed; only on
a CPU and in float32 (a GPU's steps read nothing back, and cuBLAS changes kernels with the rows; a 16-bit
product's rounding hides another order). Attention's short batches and item tiles have their own proofs
(batched.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .precision import onednn_linear

_PROVEN: dict[tuple, tuple[int, ...]] = {}


def proven_short(p: torch.Tensor, tile: int, short: tuple[int, ...], onednn: bool) -> tuple[int, ...]:
    """The row counts in `short` whose products with this weight slice give each row exactly the bits a
    (tile, K) product gives it, shown once per process, slice shape and thread count on a tile of random
    rows (every output element is a sum of K terms in the kernel's order, so another order shows in its last
    bits). Only on a CPU: a GPU's steps read nothing back (step.py), and cuBLAS changes kernels with the rows.
    Only in float32: a 16-bit product rounds its float32 sums to 8 or 11 bits, which hides another order in
    all but a few elements (in bfloat16 here, 3 of 4,800 short products differed on slices a proof passed).
    `p` is what the product takes: (N, K) for oneDNN's linear, (K, N) for `torch.mm`."""
    if not short or not provable(p.dtype, p.device):  # whole tiles: the same bits
        return ()
    key = ("short", tuple(p.shape), p.stride(), p.dtype, onednn, torch.get_num_threads(), tile, short)
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            x = _random_rows(p, tile, onednn)
            full = _product(x, p, onednn)
            _PROVEN[key] = tuple(s for s in short if s < tile and all(
                torch.equal(_product(x[i:i + s].clone(), p, onednn), full[i:i + s]) for i in range(0, tile - s + 1, s)))
    return _PROVEN[key]


def proven_long(p: torch.Tensor, tile: int, long: tuple[int, ...], onednn: bool) -> tuple[int, ...]:
    """The row counts in `long` (whole numbers of tiles) whose one product with this weight slice gives each
    row exactly the bits its own (tile, K) product gives it, shown as `proven_short` shows a short tile's: once
    per process, slice shape, thread count and library, on random rows, only on a CPU and in float32."""
    if not long or not provable(p.dtype, p.device):
        return ()
    key = ("long", tuple(p.shape), p.stride(), p.dtype, onednn, torch.get_num_threads(), tile, long)
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            longest = max(long)
            x = _random_rows(p, longest - longest % tile, onednn)
            tiles = torch.cat([_product(x[i:i + tile].clone(), p, onednn) for i in range(0, x.shape[0], tile)])
            _PROVEN[key] = tuple(s for s in long if s > tile and s % tile == 0 and all(
                torch.equal(_product(x[i:i + s].clone(), p, onednn), tiles[i:i + s])
                for i in range(0, x.shape[0] - s + 1, s)))
    return _PROVEN[key]


def proven_units(weight: torch.Tensor, bounds: list[tuple[int, int]], rows: tuple[int, ...],
                 product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether one product over a column-split weight (N, K), as it is laid out, gives each unit's output
    features [a, b) exactly the bits of the unit's own product on its row-major block `weight[a:b]`
    (invariant.TiledLinear), at each row count in `rows` (one row, the short tiles, a tile, the longest run:
    every kind of product a pass issues), shown once per process, weight shape and layout, units and thread
    count, on random rows, only where `provable`. `product(x, w)` is the tiled product."""
    if not provable(weight.dtype, weight.device):
        return False
    if len(bounds) == 1 and weight.is_contiguous():  # the unit's own product, on its own block
        return True
    key = ("units", tuple(weight.shape), weight.stride(), weight.dtype, torch.get_num_threads(), tuple(bounds), rows)
    if key not in _PROVEN:
        with unwatched(), torch.no_grad():
            x = _random_rows(weight, max(rows), onednn=True)
            blocks = [weight[a:b].contiguous() for a, b in bounds]
            _PROVEN[key] = all(torch.equal(product(x[:m], weight),
                                           torch.cat([product(x[:m], block) for block in blocks], dim=-1))
                               for m in sorted(set(rows)))
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
    batched.py): on a CPU (a GPU's steps read nothing back, step.py), in float32 (a 16-bit product's rounding
    hides another order), outside `torch.compile` (which takes whole tiles and calls)."""
    return device.type == "cpu" and dtype == torch.float32 and not torch.compiler.is_compiling()


def _random_rows(p: torch.Tensor, rows: int, onednn: bool) -> torch.Tensor:
    """Random rows (rows, K) for a proof of products with `p` ((N, K) for oneDNN's linear, else (K, N))."""
    k = p.shape[1] if onednn else p.shape[0]
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(0)).to(p.dtype)


def _product(r: torch.Tensor, p: torch.Tensor, onednn: bool) -> torch.Tensor:
    return onednn_linear(r, p) if onednn else torch.mm(r, p)


def unwatched():
    """Run outside any dispatch mode (audit.py's watchers): the proof's products are not the model's."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
