"""Sampling on the device: every row's token at once, from each question's own counter-based random stream.

`tokens.take_tokens` picks every question's next token in one step: an argmax for greedy rows, `sample_rows` for
sampled ones. A question's stream is a key (`stream_key`: seed and question index) and a draw number (the
tokens its answer holds), and its uniforms are a pure function of (key, draw, token id), so there is no
generator state to carry, nothing sampled depends on what else is in the batch, and no row of logits has to
leave the device: only the chosen tokens do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def stream_key(seed: int, index: int) -> int:
    """The random stream of question `index`: the same in every mode; a signed 64-bit key, one of its own for
    every signed 64-bit seed at an index (an odd multiplier is one-to-one modulo 2**64; modulo 2**63, seed
    -1 had been seed 2**63 - 1). Keys of seeds from 0 to 2**43 are what they were under that modulus."""
    key = (int(seed) * 1_000_003 + int(index)) % 2**64  # Python's integers: a numpy seed would overflow
    return key - 2**64 if key >= 2**63 else key


# SplitMix64's constants, as the signed 64-bit integers torch multiplies with (wrapping, on every device).
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) if c >= 1 << 63 else c
                         for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shift(z: torch.Tensor, k: int) -> torch.Tensor:
    """z >>> k, the logical right shift of 64-bit words held in int64."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix_into(z: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser, in place on z (int64, wrapping), scratch a buffer of z's shape: every bit of z
    spread over every bit of the result."""
    for k, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, k, out=scratch)
        z.bitwise_xor_(scratch.bitwise_and_((1 << (64 - k)) - 1))  # z ^= z >>> k
        if multiplier is not None:
            z.mul_(multiplier)
    return z


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of z, a new tensor."""
    return _mix_into(z.clone(), torch.empty_like(z))


def _row_words(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """(Q, 1) each row's word for draw `steps[q]` of stream `keys[q]`, which its uniforms start from."""
    return _mix(_mix(keys * _GOLDEN + 1) ^ steps)[:, None]


def uniforms(keys: torch.Tensor, steps: torch.Tensor, width: int) -> torch.Tensor:
    """(Q, width) float64 in (0, 1): draw v of step t of stream `keys[q]`, a pure function of (key, t, v).

    Counter-based: no generator state to carry, the same numbers on every device and in every batch (integer
    arithmetic, element by element), so a question's draws never depend on what else is sampled beside it."""
    z = _mix(_row_words(keys, steps) + (torch.arange(width, device=keys.device, dtype=torch.int64) + 1) * _GOLDEN)
    return (_shift(z, 11).double() + 0.5) * 2.0**-53


def gumbel(keys: torch.Tensor, steps: torch.Tensor, width: int, rows: int | None = None) -> torch.Tensor:
    """(rows, width) float64 -log(-log(u)) of `uniforms(keys, steps, width)` to the bit, in its first Q rows and
    0 in the others (rows: Q unless given); width a multiple of 64.

    A GPU takes the whole rows at once (fewer launches). A CPU takes them a few thousand columns at a time,
    in place: each chunk's words stay in cache through the two dozen element-wise passes rather than each pass
    writing 8 bytes a token of a new tensor (64 rows of a 49,152-token vocabulary: 25 MB each). The same
    operations on every element and chunks of whole 64-column vectors (no element falls to a kernel's scalar
    tail), so the same bits as the formula at once (tests/test_generate.py holds it to them)."""
    q = keys.shape[0]
    rows = q if rows is None else rows
    if keys.device.type != "cpu":
        return F.pad(-torch.log(-torch.log(uniforms(keys, steps, width))), (0, 0, 0, rows - q))
    row = _row_words(keys, steps)
    cols = min(width, max(64, (1 << 17) // max(q, 1) // 64 * 64))  # 128K words a chunk: 1 MB
    out = torch.empty((rows, width), dtype=torch.float64)
    out[q:] = 0.0
    z, scratch = torch.empty((q, cols), dtype=torch.int64), torch.empty((q, cols), dtype=torch.int64)
    for lo in range(0, width, cols):
        hi = min(lo + cols, width)
        words, spare, chunk = z[:, :hi - lo], scratch[:, :hi - lo], out[:q, lo:hi]
        torch.add(row, torch.arange(lo + 1, hi + 1, dtype=torch.int64) * _GOLDEN, out=words)
        _mix_into(words, spare)
        chunk.copy_(torch.bitwise_right_shift(words, 11, out=spare).bitwise_and_((1 << 53) - 1))
        chunk.add_(0.5).mul_(2.0**-53).log_().neg_().log_().neg_()
    return out


def sorted_rows(y: torch.Tensor, rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(y, dim=-1, descending=True, stable=True) of float64 rows without NaN: the values and order;
    a CPU sorts only `rows` (default: all) and leaves the others as they are, in the columns' order (padding
    rows, which hold one value throughout, and rows whose order nothing reads)."""
    if y.device.type != "cpu":
        return torch.sort(y, dim=-1, descending=True, stable=True)
    listed = range(len(y)) if rows is None else rows
    values, order = _sorted_listed(y, listed)
    at = torch.tensor(list(listed), dtype=torch.int64)
    every = torch.arange(y.shape[-1]).expand(y.shape).index_copy(0, at, order)
    return y.index_copy(0, at, values), every


def _sorted_listed(y: torch.Tensor, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A CPU's `sorted_rows` of y's listed rows alone: their values and order, (len(rows), width) each.

    A stable sort's order is unique, so any way to it gives the same bits. Each row's float64 values are sorted
    as 64-bit integer keys that order alike (-0.0 taken as 0.0, which it equals), which torch sorts by radix
    where it can: 64 rows of a 49,152-token vocabulary in runs here 1.2x to 2.5x faster than the sort of the
    floats at 2 threads, 3x at 1."""
    rows = list(rows)
    keys = y[rows] if len(rows) < len(y) else y.clone()  # a copy either way: the keys are made in place
    keys = _float_order_(keys.add_(0.0).view(torch.int64)).bitwise_not_()  # -0.0 + 0.0 is 0.0; ~key: descending
    ordered, order = torch.empty_like(keys), torch.empty_like(keys)
    for i in range(len(rows)):
        torch.sort(keys[i], stable=True, out=(ordered[i], order[i]))
    # back to the floats' bits, a -0.0 as 0.0 (the same in every use: they compare equal)
    return _float_order_(ordered.bitwise_not_()).view(torch.float64), order


def _float_order_(bits: torch.Tensor) -> torch.Tensor:
    """float64 bits (as int64) to integers that order as the floats do, and back (it is its own inverse), in
    place: a non-negative float's bits as they are, a negative one's with its magnitude's bits flipped (an
    arithmetic shift of the sign gives the mask: all ones or none)."""
    return bits.bitwise_xor_(torch.bitwise_right_shift(bits, 63).bitwise_and_((1 << 63) - 1))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                keys: torch.Tensor, steps: torch.Tensor, filtered: bool | Sequence[bool] = True) -> torch.Tensor:
    """The sampled token of every row of raw logits (Q, vocab), on the logits' device: (Q,) int64.

    Per row: y = (x - max x) / temperature in float64 (a tiny temperature cannot overflow it); top-k keeps the
    K likeliest (ties at the K-th kept), top-p then the smallest set reaching P; the token is the Gumbel-max
    argmax(y + g) with g = -log(-log(u)) and u the row's own `uniforms`, which picks token i with probability
    softmax(y)_i. Everything is row-wise and nothing comes back to the host. Rows are padded to whole tiles
    of 8 and columns to a multiple of 64 (-inf, never picked): an element-wise kernel then finishes no row
    with scalar code, and top-p's cumulative sum is issued on fixed (8, width) shapes, so a row's bits do not
    depend on how many rows are sampled together. `filtered=False` (no row asks for top-k or top-p) skips the
    sort, which hides nothing then: the same tokens. `filtered` may instead say which rows ask (or whose token
    is wanted at all): a CPU then sorts those alone, the same tokens in them and in every row that filters
    nothing (tests/test_generate.py).
    """
    q = logits.shape[0]
    which = [i for i, f in enumerate([filtered] * q if isinstance(filtered, bool) else filtered) if f]
    if logits.device.type != "cpu":
        return _draw(logits, temperature, top_k, top_p, keys, steps, None if which else [])
    # A CPU draws a tile of 8 rows at a time: each tile's (8, width) tensors stay in cache through the two dozen
    # passes below rather than each pass reading and writing all rows' (25 MB each at 64 rows of a 49,152-token
    # vocabulary). The same operations on every row, so the same bits (tests/test_generate.py).
    tiles = [_draw(*(a[lo:lo + 8] for a in (logits, temperature, top_k, top_p, keys, steps)),
                   [i - lo for i in which if lo <= i < lo + 8]) for lo in range(0, q, 8)]
    return torch.cat(tiles) if tiles else torch.empty(0, dtype=torch.int64)


def _draw(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
          keys: torch.Tensor, steps: torch.Tensor, listed: list[int] | None) -> torch.Tensor:
    """`sample_rows`' tokens of these rows, padded here to whole tiles of 8 rows: every row sorted for top-k and
    top-p (listed None), none ([]: no row filters), or on a CPU only the listed ones, which filter (any other
    row cuts nothing, in any order)."""
    q, vocab = logits.shape
    rows, width = -(-max(q, 1) // 8) * 8, -(-vocab // 64) * 64
    x = torch.full((rows, width), float("-inf"), dtype=torch.float64, device=logits.device)
    x[:q, :vocab] = logits
    x[q:] = 0.0  # padding rows: finite, discarded
    pad = rows - q
    t = F.pad(temperature.double(), (0, pad), value=1.0)[:, None]
    y = x.sub_(x.amax(dim=-1, keepdim=True)).div_(t)  # (rows, width), in place: the same bits, no copy
    g = gumbel(keys, steps, width, rows)  # the padding rows' noise 0: they are discarded
    if listed == []:
        return torch.argmax(y.add_(g), dim=-1)[:q]
    k = F.pad(top_k, (0, pad))[:, None]
    p_max = F.pad(top_p.double(), (0, pad), value=1.0)[:, None]
    if listed is None:
        sorted_y, order = sorted_rows(y)
    else:  # sorted_rows(y, listed) would give these too, but then its order and the scatter below span every
        # row of the tile (the padding rows too): 7-17% slower at 1 to 64 rows (docs/design.md item 5)
        at = torch.tensor(listed, dtype=torch.int64)
        values, order = _sorted_listed(y, listed)
        sorted_y = y.index_copy(0, at, values)
    kth = sorted_y.gather(1, (k.clamp(1, vocab) - 1))
    cut = (k > 0) & (sorted_y < kth)  # (rows, width) in sorted order: past the K-th
    p = torch.softmax(sorted_y.masked_fill_(cut, float("-inf")), dim=-1)  # sorted_y is read no more
    cum = torch.empty_like(p)
    for i in range(0, rows, 8):  # fixed (8, width) scans
        torch.cumsum(p[i:i + 8], dim=-1, out=cum[i:i + 8])
    cut |= (p_max < 1) & (cum.sub_(p) >= p_max)  # the smallest set reaching top_p (1: off, whatever cum rounds to)
    if listed is None:
        hidden = torch.zeros_like(cut).scatter_(1, order, cut)
    else:
        hidden = torch.zeros_like(cut).index_copy_(0, at, torch.zeros_like(cut[at]).scatter_(1, order, cut[at]))
    return torch.argmax(y.masked_fill_(hidden, float("-inf")).add_(g), dim=-1)[:q]
