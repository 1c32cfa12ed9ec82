"""Whether a device's products give a row the same bits with fewer rows beside it, and what each costs.

On a GPU a linear product is a whole tile of 256 rows (`invariant.CUDA_TILES`), or a short tile of 16 to 128
rows where the process has shown, for that weight, that cuBLAS adds the same way for the fewer rows
(`proofs.proven_short`, in the first step that meets the weight). A decode step of 64 questions then
computes 64 rows, not 256: at Llama-3-8B's shape in bfloat16 a 256-row product is bound by arithmetic (~2x
the time of reading its weight once), where 64 rows are bound by the read. This probe reports, for the
record and with times, what the device does for each product the model issues:

- linear: for each weight's shape and layout (and each unit's, at the units `minillama generate` takes by
  default), whether a product of s rows gives each row exactly the bits of the whole tile's product, on
  random rows and on *cancelling* rows (`proofs.cancelling`: a large term and its negative in every
  output's sum, so that in a 16-bit product an order of additions that differs shows in the rounded result
  too, where random rows can hide it); and, for a column split, whether one product over all the units
  gives each unit its own bits (`proofs.proven_units`);
- attention: for each kind of item, whether a call of fewer items, or items of fewer rows, gives each item
  the whole call's bits (the float32 products and sums of `batched`), which no GPU proves yet;
- each product's median time at each row count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..batched import batched_products, batched_row_sums
from ..blocks import KEY_BLOCK
from ..invariant import default_tiles, unit_bounds
from ..proofs import cancelling, same_rows
from .shapes import SHAPES

ROWS = (1, 16, 64, 128)  # the row counts tried against a whole tile


def _weights(config: Any, units: int) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, column-major) of each product the model issues, and its units' where units > 1."""
    h, hd, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    i = config.intermediate_size
    whole = {"q": (hd, h, False), "kv": (kv, h, False), "o": (h, hd, True), "gate_up": (i, h, False), "down": (h, i, True)}
    out = dict(whole)
    if units > 1:
        for name, (n, k, rows_split) in whole.items():
            a, b = unit_bounds(k if rows_split else n, units)[0]
            out[f"{name} unit"] = (n, b - a, False) if rows_split else (b - a, k, False)
    return out


def _operand(n: int, k: int, column_major: bool, dtype: torch.dtype, device: torch.device,
             g: torch.Generator) -> torch.Tensor:
    """A weight (N, K) of random values in the layout the model keeps, as the product takes it: (K, N)."""
    w = (torch.randn(n, k, generator=g, device=device) * 2.0 ** -8).to(dtype)
    return (w.t().contiguous().t() if column_major else w).t()


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    """The median time of fn() over `repeats` calls after one (device events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def linear_rows(config: Any, dtype: torch.dtype, device: torch.device, tile: int, repeats: int = 20
                ) -> dict[str, dict[str, Any]]:
    """Per product (and unit): the row counts whose products give every row the whole tile's bits, on random
    and on cancelling rows; each row count's median ms; for a column unit, whether one product over all the
    units gives it its bits."""
    g = torch.Generator(device=device).manual_seed(0)
    counts = [s for s in ROWS if s < tile]
    units, whole = config.num_key_value_heads, _weights(config, 1)
    out = {}
    for name, (n, k, column_major) in _weights(config, units).items():
        p = _operand(n, k, column_major, dtype, device, g)
        x = torch.randn(tile, k, generator=g, device=device).to(dtype)
        xc, pc = cancelling(x, p)
        rec: dict[str, Any] = {"n": n, "k": k, "column_major": column_major,
                               "same_bits_random": [s for s in counts if same_rows(x, p, s)],
                               "same_bits_cancelling": [s for s in counts if same_rows(xc, pc, s)],
                               "ms": {str(s): _median_ms(lambda s=s: torch.mm(x[:s], p), device, repeats)
                                      for s in counts + [tile]}}
        if name.endswith("unit") and not whole[name[:-5]][2]:  # a column unit of a whole weight
            whole_n = whole[name[:-5]][0]
            wp = _operand(whole_n, k, False, dtype, device, g)
            wc = cancelling(x, wp)
            rec["one_product_same_bits"] = all(
                torch.equal(torch.mm(xi, pi)[:, a:b], torch.mm(xi, pi[:, a:b].contiguous()))
                for xi, pi in ((x, wp), wc) for a, b in unit_bounds(whole_n, units))
        out[name] = rec
    return out


def attention_items(config: Any, device: torch.device, repeats: int = 20) -> dict[str, dict[str, Any]]:
    """Per kind of attention item (the device's tiles): the item counts and the item row counts whose calls
    give each item the bits of a whole batch of whole tiles, and each call's median ms."""
    g = torch.Generator(device=device).manual_seed(1)
    d = config.head_dim
    out = {}
    for name, kind in (("whole", default_tiles(device).attention.whole),
                       ("partial", default_tiles(device).attention.partial)):
        n, t = kind.batch, kind.rows
        q, k, v = (torch.randn(n, rows, d, generator=g, device=device) for rows in (t, KEY_BLOCK, KEY_BLOCK))
        e = torch.rand(n, t, KEY_BLOCK, generator=g, device=device)

        def calls(q, e, batch):
            return (batched_products(q, k[:q.shape[0]].transpose(1, 2), batch),
                    batched_products(e, v[:q.shape[0]], batch), batched_row_sums(e, batch))

        whole = calls(q, e, n)
        fewer_items = [b for b in (n // 8, n // 4, n // 2) if b >= 1 and all(
            torch.equal(a, c[:b]) for a, c in zip(calls(q[:b], e[:b], b), whole))]
        fewer_rows = [r for r in (1, 4, t // 2) if r < t and all(
            torch.equal(a, c[:, :r]) for a, c in zip(calls(q[:, :r].contiguous(), e[:, :r].contiguous(), n), whole))]
        out[name] = {"batch": n, "rows": t, "keys": KEY_BLOCK, "same_bits_items": fewer_items,
                     "same_bits_rows": fewer_rows,
                     "ms": {f"{r} rows": _median_ms(lambda r=r: calls(q[:, :r].contiguous(), e[:, :r].contiguous(), n),
                                                    device, repeats) for r in sorted({*fewer_rows, 4, t}) if r <= t}}
    return out


def probe(shape: str, dtype_name: str, device_name: str, quick: bool = False) -> dict[str, Any]:
    """The whole probe at a named shape (at `quick`, the tiny shape's), in the shape's dtype."""
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    config = SHAPES["tiny" if quick else shape]
    tile = default_tiles(device).rows
    with torch.no_grad():
        return {"shape": "tiny" if quick else shape, "dtype": dtype_name, "tile": tile,
                "linear": linear_rows(config, dtype, device, tile, repeats=3 if quick else 20),
                "attention": attention_items(config, device, repeats=3 if quick else 20)}
