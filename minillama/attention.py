"""Who sees whom, and the batch-invariant attention kernel: the rule, a blocked reference, the fast kernel.

Shape notation:

    N    new tokens in the pass (the model pads them to n_rows: model.py)
    H    query heads;  Hkv  key/value heads;  G = H / Hkv  query heads per KV head
    D    head dim
    S    cache slots
    R    query rows per KV head: n_rows * G, row n * G + g is query head g of token n
    B    keys per block (KEY_BLOCK)
    T    query rows per tile
    I    (query tile, key block) items

The module reads top-down: the rule (`segment_attention`), the blocked order that makes it bit-exact
(`reference_attention`, one row at a time), the plan of a pass (plan.py) and the fast kernel
(`blocked_attention`), which a test holds equal to the reference to the bit.

The segment rule (cache.py has the segments). A query token q sees key token k when

    visible(q, k) = k.segment in chain(q.segment)  and  k.position <= q.position

where chain(s) is s and its ancestors. A question sees its whole document and its own earlier tokens;
a document never sees its questions; unrelated prompts (separate roots) never see each other. A model
with a sliding window W (Mistral) adds one more edge, HF's convention:

    ... and  q.position - k.position < W

so a query at position p sees the positions max(0, p - W + 1) .. p of its chain.

Why not one masked softmax over the packed sequence: a reduction over a longer row with -inf holes uses
another summation order than the reduction over the question's own prompt, and the last bits differ
(docs/design.md). Instead each query row's keys are taken in *logical* order (its chain, by position) and
cut into blocks at positions 0, B, 2B, ...:

1. every (row, block) pair is one row of a fixed-shape product: a tile of T query rows against the B keys
   of one block. A block the row sees whole is a *whole* item; a block it sees in part is a *partial*,
   masked item (blocks.py: the two kinds, `visible_blocks`, and each kind's sizes, `AttentionTiles`).
   Which kind a pair is depends on the row's position only; blocks wholly before the window are not
   visited.
2. the row's maximum score over all its keys is exact (a maximum does not depend on order);
3. each block gives exp(score - max), its sum and its weighted values; the blocks are added onto zero one
   after another: the whole blocks in block order, then the partial blocks in block order.

All of this depends only on the row's own logical sequence, so a question gets the same bits packed with a
thousand others as alone.

Sharing (Hydragen): all rows that see the same whole block (the 64 questions of a document, each decoding
one token) are tiled together, so each tile of query rows meets a document block in one product: the
document's keys are read once per tile, not once per question.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .batched import (WIDTH, batched_products, batched_row_sums, run_row_sums, run_scores, run_values, scan_sums,
                      sums_in_order)
from .blocks import KEY_BLOCK, AttentionTiles, ItemTiles, first_visible, visible_blocks
from .cache import PAD_SLOT
from .plan import AttentionPlan, Items


# --- 1. the rule: a plain softmax over the keys a token sees --------------------------------------------

def segment_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chain_slots: list[int],
                      position: int, window: int | None = None) -> torch.Tensor:
    """The specification: query rows of one token attend to its chain's keys at the visible positions.

    q: (Hkv, M, D) rows of one token (M = 1 for one row, G for all its query heads); k_cache, v_cache:
    (Hkv, S, D); chain_slots[i] is the cache slot of position i of the token's chain (KVCache.chain_slots).
    Returns (Hkv, M, D) in q's dtype, at least float32: given float64, it checks the kernels below to a
    tolerance (their bits follow the blocked order, not this one).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    key_positions = torch.arange(len(chain_slots), device=q.device)  # (K,) the chain's keys, by position
    hidden = (key_positions > position) | (key_positions < first_visible(position, window))
    slots = torch.tensor(chain_slots, dtype=torch.long, device=q.device)
    keys, values = k_cache[:, slots].to(acc), v_cache[:, slots].to(acc)  # (Hkv, K, D)
    scores = q.to(acc) @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])  # (Hkv, M, K)
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ values


# --- 2. the blocked reference: the same rule in the order that makes it bit-exact, one row at a time --------

def _block_scores(q: torch.Tensor, k: torch.Tensor, batch: int, hidden: torch.Tensor | None) -> torch.Tensor:
    """(I, T, B) scores of query tiles q (I, T, D) against key blocks k (I, B, D); -inf where `hidden`."""
    scores = batched_products(q, k.transpose(1, 2), batch)
    return scores if hidden is None else scores.masked_fill_(hidden, float("-inf"))


def _finite(row_max: torch.Tensor) -> torch.Tensor:
    """Maxima of rows that see nothing (-inf) become 0, so that exp(-inf - 0) = 0 rather than NaN."""
    return row_max.nan_to_num(neginf=0.0)


def fused_items(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int,
                hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each item's softmax over its own block, by torch's fused CPU kernel in calls of exactly `batch` items.

    q: (I, T, D) query tiles (already scaled), k, v: (I, B, D) key blocks, hidden: (I, T, B) or None. Returns
    (o, lse): o (I, T, D) the row's softmax over the block's visible keys times their values, lse (I, T) the
    log of its sum of exp(score). The kernel takes each item alone, its splits fixed by T and B; a row that
    sees nothing gets lse -inf and o 0 (the kernel itself reports lse 0 there).
    """
    if q.device.type != "cpu":
        raise ValueError(f"AttentionTiles.fused runs torch's CPU attention kernel; this pass is on {q.device}")
    d = v.shape[2]
    if d % WIDTH:  # a ragged head size, padded with zeros as batched_products pads (its rows' bits moved too)
        wide = [F.pad(x, (0, -d % WIDTH)) for x in (q, k, v)]
        o, lse = fused_items(*wide, batch, hidden)
        return o[..., :d].contiguous(), lse
    outs, lses = [q.new_empty(0, q.shape[1], v.shape[2])], [q.new_empty(0, q.shape[1])]  # a kind with no items
    for start in range(0, q.shape[0], batch):
        part = slice(start, start + batch)
        mask = None if hidden is None else q.new_zeros(hidden[part].shape).masked_fill_(hidden[part], float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(  # (batch, 1, T, D), (batch, 1, T)
            q[part, None], k[part, None], v[part, None], 0.0, False,
            attn_mask=None if mask is None else mask[:, None], scale=1.0)
        outs.append(o[:, 0])
        lses.append(lse[:, 0])
    o, lse = torch.cat(outs), torch.cat(lses)
    return o, lse if hidden is None else lse.masked_fill_(hidden.all(dim=-1), float("-inf"))


def _fused_terms(o: torch.Tensor, lse: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """(I, T, D + 1) an item's terms from its softmax: o and 1, each times exp(lse - the row's maximum lse)."""
    weight = (lse - row_max).exp_().unsqueeze(-1)  # (I, T, 1): the block's share, exactly 0 where it saw nothing
    return torch.cat([o * weight, weight], dim=-1)


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: list[int],
                        key_slots: list[list[int]], tiles: AttentionTiles, window: int | None = None) -> torch.Tensor:
    """The blocked rule written for a reader: each query row alone, its logical blocks in order.

    q: (Hkv, N * G, D) query rows (row n * G + g is query head g of token n); k_cache, v_cache: (Hkv, S, D);
    positions[n] and key_slots[n] (the cache slots of positions 0 .. positions[n] of token n's chain);
    `window`: the sliding window, None for none. Returns (Hkv, N * G, D). The row is placed in a tile of
    zeros, and the tile in a batch of dummy items, so that every product has the shape the fast kernel gives
    it: the bits are the same.
    """
    hkv, rows, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    B, G = KEY_BLOCK, rows // max(len(positions), 1)
    out = q.new_zeros(hkv, rows, d, dtype=acc)
    for head in range(hkv):
        for row in range(rows):
            position, slots = positions[row // G], key_slots[row // G]
            first = first_visible(position, window)
            whole_blocks, partial_blocks = visible_blocks(position, window)
            scores, values = [], []
            for block in [*whole_blocks, *partial_blocks]:  # the order the blocks are added in
                whole = block in whole_blocks  # the row sees every key of the block
                kind = tiles.whole if whole else tiles.partial
                tile, batch = kind.rows, kind.batch
                padding = [PAD_SLOT] * max(0, block * B + B - len(slots))
                block_slots = torch.tensor(slots[block * B:block * B + B] + padding)  # (B,)
                q_tile = q.new_zeros(batch, tile, d, dtype=acc)  # (batch, T, D): the row at [0, 0]
                q_tile[0, 0] = q[head, row].to(acc) * (1.0 / math.sqrt(d))
                k_block = k_cache.new_zeros(batch, B, d, dtype=acc)  # (batch, B, D): the block at [0]
                k_block[0] = k_cache[head, block_slots].to(acc)
                v_block = torch.zeros_like(k_block)
                v_block[0] = v_cache[head, block_slots].to(acc)
                key_positions = torch.arange(block * B, block * B + B, device=q.device)
                cut = (key_positions > position) | (key_positions < first)  # (B,) keys a partial block hides
                hidden = None if whole else cut.expand(batch, tile, B)
                if tiles.fused:  # the block's softmax and log-sum-exp: its own maximum stands in for scores
                    scores.append(fused_items(q_tile, k_block, v_block, batch, hidden))
                else:
                    scores.append(_block_scores(q_tile, k_block, batch, hidden))
                values.append(v_block)
            if tiles.fused:  # each block weighted by exp(its log-sum-exp - the row's largest), in block order
                row_max = _finite(torch.stack([lse[0, 0] for _, lse in scores]).max())
                sums = q.new_zeros(d + 1, dtype=acc)  # weighted values, softmax sum
                for o, lse in scores:
                    sums = sums + _fused_terms(o, lse, row_max)[0, 0]
                out[head, row] = sums[:d] / sums[d:]
                continue
            row_max = _finite(torch.stack([s[0, 0].max() for s in scores]).max())  # the row's exact maximum
            weighted, total = q.new_zeros(d, dtype=acc), q.new_zeros((), dtype=acc)
            for block_scores, v_block in zip(scores, values):
                e = (block_scores - row_max).exp()  # (batch, T, B), the row at [0, 0]
                weighted = weighted + batched_products(e, v_block, v_block.shape[0])[0, 0]
                total = total + batched_row_sums(e, v_block.shape[0])[0, 0, 0]
            out[head, row] = weighted / total
    return out


# --- 3. the plan: plan.py lays out a pass's (query tile, key block) items for the kernel below -------------

# --- 4. the fast kernel: the reference's products for the whole pass in a few batched calls ----------------

def _add_rows(out: torch.Tensor, rows: torch.Tensor, terms: torch.Tensor, index_add: bool) -> None:
    """out[rows[i]] += terms[i], each real row at most once per call (the spare row takes the rest).

    Either way it is one IEEE addition per element, so the bits do not depend on which way: `index_add_`
    is one launch (a GPU's choice, `AttentionTiles.index_add`), but a CPU's runs orders of magnitude slower with
    few threads than a gather, an add and a plain `index_put_` (docs/design.md has the measurement).
    """
    if index_add:
        out.index_add_(0, rows, terms)
    else:
        out.index_put_((rows,), out.index_select(0, rows).add_(terms))


def _gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """src rows at index (I, n): (I, n, D). index_select copies whole rows (a plain src[index] goes by element)."""
    return src.index_select(0, index.reshape(-1)).view(*index.shape, src.shape[-1])


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                      tiles: AttentionTiles) -> torch.Tensor:
    """q: (Hkv, R, D) query rows; k_cache, v_cache: (Hkv, S, D). Returns (Hkv, R, D), at least float32.

    Pass 1 finds each row's exact maximum over all its items; pass 2 takes exp(score - max), its sum and its
    weighted values per item, and adds each row's terms onto zero in block order. Where every item fits at
    once (`plan.order`: every decode step) the terms are added in row order, in a loop whose length the
    plan's shape fixes (`_add_in_row_order`); otherwise block after block, in chunks (`_add_by_block`). Both
    perform the same IEEE additions in the same order, so they give the same bits.
    """
    hkv, r, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax arithmetic: float32 for 16-bit models
    # Row R of each head, zeros, pads tiles: (Hkv * (R + 1), D).
    queries = F.pad(q.to(acc) * (1.0 / math.sqrt(d)), (0, 0, 0, 1)).view(-1, d)
    keys, values = k_cache.reshape(-1, d), v_cache.reshape(-1, d)  # (Hkv * S, D): flat slots, a view
    add = _add_by_block if plan.order is None else _add_in_row_order
    sums = add(queries, keys, values, plan, tiles)  # (Hkv * (R + 1), D + 1): weighted values, softmax sum
    sums = sums.view(hkv, r + 1, d + 1)[:, :r]  # (Hkv, R, D + 1)
    # Padded token rows saw nothing (sum 0): the floor keeps them 0 rather than 0/0.
    return sums[..., :d] / sums[..., d:].clamp_min(torch.finfo(acc).tiny)


def _run_blocks(keys: torch.Tensor, values: torch.Tensor, items: Items, dtype: torch.dtype) -> dict[int, tuple]:
    """Each run's (Items.runs) key block (B, D) and value block transposed (D, B), by its first item: gathered
    for all of a kind's runs at once, two gathers a layer rather than two or three a run."""
    if not items.runs:
        return {}
    slots = items.keys[[lo for lo, _, _ in items.runs]].reshape(-1)  # (runs * B,)
    k = keys.index_select(0, slots).view(len(items.runs), KEY_BLOCK, -1).to(dtype)
    v_t = values.index_select(0, slots).view(len(items.runs), KEY_BLOCK, -1).to(dtype).transpose(1, 2).contiguous()
    return {lo: (k[i], v_t[i]) for i, (lo, _, _) in enumerate(items.runs)}


def _scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, items: Items, lo: int, hi: int,
            batch: int, fused: bool, run: int | None = None, block: tuple | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Pass 1 of items lo .. hi - 1: their (I, T, B) scores, hidden keys at -inf; or, fused, their softmax
    and log-sum-exp (`fused_items`). A `run` (Items.runs: its first flat row, or -1) meets one key block
    (`block`, `_run_blocks`): one product, its query rows one slice where they follow one another."""
    hidden = None if items.hidden is None else items.hidden[lo:hi]
    if run is not None:
        rows = items.rows[lo:hi]
        q = queries[run:run + rows.numel()].view(*rows.shape, -1) if run >= 0 else _gather(queries, rows)
        return run_scores(q, block[0])
    q, k = _gather(queries, items.rows[lo:hi]), _gather(keys, items.keys[lo:hi]).to(queries.dtype)
    if fused:
        return fused_items(q, k, _gather(values, items.keys[lo:hi]).to(queries.dtype), batch, hidden)
    return _block_scores(q, k, batch, hidden)


def _peaks(scores: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """(I, T) what the row maximum is taken over: each item's largest score, or its log-sum-exp."""
    return scores[1] if isinstance(scores, tuple) else scores.amax(dim=-1)


def _terms(scores: torch.Tensor | tuple[torch.Tensor, torch.Tensor], row_max: torch.Tensor, rows: torch.Tensor,
           values: torch.Tensor, items: Items, lo: int, hi: int, batch: int, run: int | None = None,
           into: torch.Tensor | None = None, block: tuple | None = None) -> torch.Tensor | None:
    """(I, T, D + 1) each item's weighted values and, in column D, its softmax sum; scores is overwritten. A
    run whose rows are one slice of the sums may add its terms `into` that slice instead (one addition each)."""
    if run is not None and run >= 0:  # a run's rows one slice
        item_max = row_max[run:run + rows.numel()].view(rows.shape)  # (I, T)
    else:
        item_max = row_max.index_select(0, rows.reshape(-1)).view(rows.shape)
    if isinstance(scores, tuple):
        return _fused_terms(*scores, item_max)
    e = scores.sub_(item_max.unsqueeze(-1)).exp_()  # (I, T, B)
    if run is not None:
        weighted = run_values(e, block[1])  # (I, T, D)
        if into is None:
            return torch.cat([weighted, run_row_sums(e)], dim=-1)
        into[:, :-1] += weighted.view(into.shape[0], -1)
        into[:, -1:] += run_row_sums(e).view(into.shape[0], 1)
        return None
    values = _gather(values, items.keys[lo:hi]).to(e.dtype)
    return torch.cat([batched_products(e, values, batch), batched_row_sums(e, batch)], dim=-1)


def _kinds(plan: AttentionPlan, tiles: AttentionTiles) -> list[tuple[Items, ItemTiles]]:
    """The pass's items, kind after kind in the order their terms are added (plan.row_order): whole blocks,
    whole blocks in short tiles (`AttentionPlan.small`), partial blocks."""
    small = [] if plan.small is None else [(plan.small, tiles.whole)]
    return [(plan.whole, tiles.whole), *small, (plan.partial, tiles.partial)]


def _add_in_row_order(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
                      tiles: AttentionTiles) -> torch.Tensor:
    """Every item at once; each row's terms then gathered by `plan.order` and added in J fixed steps.

    Nothing here depends on a value of the pass, only on its plan's shapes: the step a GPU captures.
    """
    d = queries.shape[1]
    kinds = [(items, kind.batch, _pieces(items, max(items.count, 1)), _run_blocks(keys, values, items, queries.dtype))
             for items, kind in _kinds(plan, tiles)]
    # each kind's pieces' scores (one piece: a GPU's, the fused path's)
    scores = [[_scores(queries, keys, values, items, lo, hi, batch, tiles.fused, run, blocks.get(lo))
               for lo, hi, run in pieces] for items, batch, pieces, blocks in kinds]
    # Pass 1: each row's maximum over its items' peaks, gathered by `plan.order` like its terms (a peak for
    # every term, numbered alike; the zero term's is -inf): a gather and a max rather than atomic scatters.
    peaks = torch.cat([*(_peaks(p).reshape(-1) for parts in scores for p in parts), queries.new_full((1,), -math.inf)])
    row_max = _finite(peaks.index_select(0, plan.order.reshape(-1)).view(plan.order.shape).amax(dim=1))
    terms = [_terms(part, row_max, items.rows[lo:hi], values, items, lo, hi, batch, run, block=blocks.get(lo))
             .view(-1, d + 1) for (items, batch, pieces, blocks), parts in zip(kinds, scores)
             for part, (lo, hi, run) in zip(parts, pieces)]
    terms = torch.cat([*terms, queries.new_zeros(1, d + 1)])  # (terms + 1, D + 1): the last one is zero
    ordered = terms.index_select(0, plan.order.reshape(-1)).view(*plan.order.shape, d + 1)  # (rows, J, D + 1)
    # Pass 2's additions: each row's j-th term, in every row at once; as one scan where proven to give the
    # same bits (batched.proven_scan: a GPU's eager scan, one launch; never a compiled one, which is unproven).
    return scan_sums(ordered) if plan.scan and not torch.compiler.is_compiling() else sums_in_order(ordered)


def _pieces(items: Items, chunk: int) -> list[tuple[int, int, int | None]]:
    """(lo, hi, run): each of the kind's runs alone (Items.runs; run: its first row or -1), the items between
    them in chunks (run None)."""
    pieces, start = [], 0
    for lo, hi, first in [*items.runs, (items.count, items.count, None)]:
        pieces += [(at, min(at + chunk, lo), None) for at in range(start, lo, chunk)]
        pieces += [(lo, hi, first)] if lo < hi else []
        start = hi
    return pieces or [(0, 0, None)]


def _add_by_block(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan,
                  tiles: AttentionTiles) -> torch.Tensor:
    """Items in chunks of at most `ItemTiles.chunk` (all at once when a kind has at most `keep`), each run of
    one key block as a piece of its own (Items.runs); each block's terms added onto its rows in block order
    (`_add_rows`: a row meets each block once, so every call adds one term to it). Pass 1 holds its pieces'
    scores for pass 2, the first always and more up to `AttentionTiles.hold` items of a kind; pass 2 computes
    the rest again (the same products, the same bits) rather than hold them all."""
    d = queries.shape[1]
    kinds = [(items, kind.batch, _pieces(items, items.count if 0 < items.count <= tiles.keep else kind.chunk),
              _run_blocks(keys, values, items, queries.dtype)) for items, kind in _kinds(plan, tiles)]  # _kinds' order

    row_max = queries.new_full((queries.shape[0],), float("-inf"))  # pass 1: each row's maximum
    held = []  # each kind's first pieces' scores: its first piece, and more as far as `hold` allows
    for items, batch, pieces, blocks in kinds:
        held.append([])
        for n, (lo, hi, run) in enumerate(pieces):
            piece_scores = _scores(queries, keys, values, items, lo, hi, batch, tiles.fused, run, blocks.get(lo))
            if run is not None and run >= 0:  # a run's rows one slice
                peak = row_max[run:run + piece_scores.shape[0] * piece_scores.shape[1]]
                torch.maximum(peak, _peaks(piece_scores).view(-1), out=peak)
            else:
                row_max.scatter_reduce_(0, items.rows[lo:hi].reshape(-1), _peaks(piece_scores).reshape(-1), "amax")
            if n == 0 or hi <= tiles.hold:
                held[-1].append(piece_scores)
    row_max = _finite(row_max)

    sums = queries.new_zeros(queries.shape[0], d + 1)  # pass 2: weighted values and, in column D, the softmax sum
    for (items, batch, pieces, blocks), kept in zip(kinds, held):
        for n, (lo, hi, run) in enumerate(pieces):
            if n < len(kept):  # held: its memory goes as soon as its terms are taken
                piece_scores, kept[n] = kept[n], None
            else:
                piece_scores = _scores(queries, keys, values, items, lo, hi, batch, tiles.fused, run, blocks.get(lo))
            rows = items.rows[lo:hi]
            if run is not None and run >= 0:  # one block, its rows one slice of the sums
                _terms(piece_scores, row_max, rows, values, items, lo, hi, batch, run,
                       into=sums[run:run + rows.numel()], block=blocks[lo])
                continue
            terms = _terms(piece_scores, row_max, rows, values, items, lo, hi, batch, run, block=blocks.get(lo))
            for first, end in zip(items.bounds, items.bounds[1:]):  # one block after another
                first, end = max(first, lo), min(end, hi)
                if first < end:
                    _add_rows(sums, rows[first - lo:end - lo].reshape(-1), terms[first - lo:end - lo].view(-1, d + 1),
                              tiles.index_add)
    return sums


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: AttentionPlan) -> torch.Tensor:
    """The plain way: one softmax over every cache slot with the segment rule as a mask.

    Mathematically equal to `blocked_attention`, but not bit-equal across batches (the negative control).
    """
    hkv, r, d = q.shape
    g = plan.group_size
    n = r // g
    acc = torch.promote_types(q.dtype, torch.float32)
    qh = q.view(hkv, n, g, d).permute(0, 2, 1, 3).reshape(1, hkv * g, n, d).to(acc)  # (1, H, N, D)
    out = F.scaled_dot_product_attention(qh, k_cache[None].to(acc), v_cache[None].to(acc),
                                         attn_mask=plan.visible, enable_gqa=True)
    return out.view(hkv, g, n, d).permute(0, 2, 1, 3).reshape(hkv, r, d)
