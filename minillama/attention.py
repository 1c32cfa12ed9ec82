"""Who sees whom, and the batch-invariant attention kernel (a readable reference and the fast version).

Notation for tensor shapes: N new tokens in this forward pass, H query heads, Hkv key/value heads,
G = H / Hkv query heads per KV head, D head dim, S cache slots, R = N * G query rows per KV head,
B keys per block, T query rows per tile, I (tile, block) items.

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
   of one block. Blocks the row sees whole use tiles of `Tiles.full` rows; a block the row sees in part,
   masked, tiles of `Tiles.part` rows: the block holding the row's own position (cut on the right) and,
   with a window, the block holding its first visible position (cut on the left; one block may be cut on
   both sides). Which kind a pair is depends on the row's position only; blocks wholly before the window
   are not visited.
2. the row's maximum score over all its keys is exact (a maximum does not depend on order);
3. each block gives exp(score - max), its sum and its weighted values; the blocks are added onto zero one
   after another: the whole blocks in block order, then the cut blocks in block order.

All of this depends only on the row's own logical sequence, so a question gets the same bits packed with a
thousand others as alone. `reference_attention` does exactly this, one row and one block at a time;
`blocked_attention` does the same products for the whole pass in a few batched calls, and a test checks
that the two agree to the bit.

Sharing (Hydragen): all rows that see the same whole block (the 64 questions of a document, each decoding
one token) are tiled together, so each tile of 64 query rows meets a document block in one product: the
document's keys are read once per tile, not once per question.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .cache import PAD_SLOT, KVCache
from .invariant import Tiles

KEY_BLOCK = 64  # B: keys per block, aligned to logical positions
NEVER = torch.iinfo(torch.long).max  # the position of a padding key: never visible


# --- the fixed-shape products, shared by the reference and the fast kernel ------------------------------

def batched_products(a: torch.Tensor, b: torch.Tensor, batch: int) -> torch.Tensor:
    """out[i] = a[i] @ b[i] for I items, issued as `bmm` calls of exactly `batch` items each.

    a: (I, T, K), b: (I, K, N), I a multiple of `batch` (the plan pads with dummy items). Returns (I, T, N).
    The batch count is part of a product's signature: a backend may pick another kernel for another count
    (cuBLAS does for a batch of one), so it never follows the size of the pass.
    """
    out = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    for i in range(0, a.shape[0], batch):
        torch.bmm(a[i:i + batch], b[i:i + batch], out=out[i:i + batch])
    return out


def batched_row_sums(e: torch.Tensor, batch: int) -> torch.Tensor:
    """e.sum(-1, keepdim=True) for e (I, T, B), issued as sums over exactly `batch` items each.

    A reduction's kernel, like a product's, may follow the shape it is given (a GPU's splits a row across
    more threads when there are fewer rows), so it too never sees the size of the pass.
    """
    out = e.new_empty(e.shape[0], e.shape[1], 1)
    for i in range(0, e.shape[0], batch):
        torch.sum(e[i:i + batch], dim=-1, keepdim=True, out=out[i:i + batch])
    return out


def _block_scores(q: torch.Tensor, k: torch.Tensor, batch: int, hidden: torch.Tensor | None) -> torch.Tensor:
    """(I, T, B) scores of query tiles q (I, T, D) against key blocks k (I, B, D); -inf where `hidden`."""
    s = batched_products(q, k.transpose(1, 2), batch)
    return s if hidden is None else s.masked_fill_(hidden, float("-inf"))


def _finite(m: torch.Tensor) -> torch.Tensor:
    """Maxima of rows that see nothing (-inf) become 0, so that exp(-inf - 0) = 0 rather than NaN."""
    return m.nan_to_num(neginf=0.0)


# --- the reference: one query row at a time ------------------------------------------------------------

def visible_blocks(p: int, window: int | None) -> tuple[range, list[int]]:
    """The blocks a query at position p visits: (whole blocks, cut blocks), each in block order."""
    B = KEY_BLOCK
    first = 0 if window is None else max(0, p - window + 1)  # the first visible position
    whole = range(-(-first // B), (p + 1) // B)
    return whole, [b for b in sorted({first // B, p // B}) if b not in whole]


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: list[int],
                        key_slots: list[list[int]], tiles: Tiles, window: int | None = None) -> torch.Tensor:
    """The blocked rule written for a reader: each query row alone, its logical blocks in order.

    q: (Hkv, N * G, D) query rows (row n * G + i is query head i of token n); k_cache, v_cache: (Hkv, S, D);
    positions[n] and key_slots[n] (the cache slots of positions 0 .. positions[n] of token n's chain);
    `window`: the sliding window, None for none. Returns (Hkv, N * G, D). The row is placed in a tile of
    zeros, and the tile in a batch of dummy items, so that every product has the shape the fast kernel gives
    it: the bits are the same.
    """
    hkv, r, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    B, g = KEY_BLOCK, r // max(len(positions), 1)
    out = q.new_zeros(hkv, r, d, dtype=acc)
    for h in range(hkv):
        for row in range(r):
            n = row // g
            p, slots = positions[n], key_slots[n]
            first = 0 if window is None else max(0, p - window + 1)
            whole_blocks, cut_blocks = visible_blocks(p, window)
            scores, values = [], []
            for b in [*whole_blocks, *cut_blocks]:  # the order the blocks are added in
                whole = b in whole_blocks  # the row sees every key of block b
                t, batch = (tiles.full, tiles.full_batch) if whole else (tiles.part, tiles.part_batch)
                blk = torch.tensor(slots[b * B:b * B + B] + [PAD_SLOT] * max(0, b * B + B - len(slots)))
                qt = q.new_zeros(batch, t, d, dtype=acc)
                qt[0, 0] = q[h, row].to(acc) * (1.0 / math.sqrt(d))
                kb = k_cache.new_zeros(batch, B, d, dtype=acc)
                kb[0] = k_cache[h, blk].to(acc)
                vb = torch.zeros_like(kb)
                vb[0] = v_cache[h, blk].to(acc)
                key_pos = torch.arange(b * B, b * B + B, device=q.device)
                hidden = None if whole else ((key_pos > p) | (key_pos < first)).expand(batch, t, B)
                scores.append(_block_scores(qt, kb, batch, hidden))
                values.append(vb)
            m = _finite(torch.stack([s[0, 0].max() for s in scores]).max())  # the row's exact maximum
            o, l_sum = q.new_zeros(d, dtype=acc), q.new_zeros((), dtype=acc)
            for s, vb in zip(scores, values):
                e = (s - m).exp()  # (batch, t, B), the row in [0, 0]
                o = o + batched_products(e, vb, vb.shape[0])[0, 0]
                l_sum = l_sum + batched_row_sums(e, vb.shape[0])[0, 0, 0]
            out[h, row] = o / l_sum
    return out


# --- the fast kernel: the same products for the whole pass ----------------------------------------------

@dataclass
class Items:
    """(query tile, key block) items of one kind, padded to whole batches, sorted by block.

    Rows and keys are flat indices, so one gather fetches the tiles of every KV head: query row r of KV
    head h is `h * (R + 1) + r`, the spare row `R` of head 0 pads tiles; key slot s of head h is `h * S + s`.
    """

    rows: torch.Tensor  # (I, T) flat query rows
    keys: torch.Tensor  # (I, B) flat key slots; PAD_SLOT (always zeros) pads a block
    hidden: torch.Tensor | None  # (I, T, B) True where the key is not visible; None: whole blocks
    bounds: list[int]  # items of the k-th distinct block are bounds[k] .. bounds[k + 1]

    @property
    def count(self) -> int:
        return self.rows.shape[0]


@dataclass
class AttentionPlan:
    """What attention needs for one forward pass, shared by all layers."""

    positions: torch.Tensor  # (N,)
    group_size: int  # G
    whole: Items  # blocks the rows see whole: Tiles.full rows per tile
    partial: Items  # each row's own, masked block (its last): Tiles.part rows per tile
    # Dense masked path (negative control): visible cache slots of each token.
    visible: torch.Tensor | None = None  # (N, S) bool


def plan_attention(cache: KVCache, segments: torch.Tensor, positions: torch.Tensor, group_size: int,
                   n_rows: int, tiles: Tiles, dense: bool = False, window: int | None = None) -> AttentionPlan:
    """Lay out the blocked attention of new tokens already given slots in `cache` (KVCache.append).

    `n_rows` >= N is the padded token count the model runs (model.py says why); `window`: the sliding
    window (config.sliding_window), None for none.
    """
    device = cache.k.device
    seg_list, pos_list = segments.tolist(), positions.tolist()
    B, G = KEY_BLOCK, group_size
    hkv, s = cache.k.shape[1], cache.k.shape[2]
    stride = n_rows * G + 1  # query rows per KV head, the spare row included
    spare = n_rows * G

    by_seg: dict[int, list[int]] = {}  # new tokens of each segment, in position order
    for i, sid in enumerate(seg_list):
        by_seg.setdefault(sid, []).append(i)

    # A query at position p sees whole blocks w .. f - 1 and part of the blocks holding p and its first
    # visible position, unless they are whole (visible_blocks). Whole block b belongs to the chain segment
    # holding its last position bB + B - 1 (its "owner"): the queries of all segments under that owner see
    # the same keys there, so they share tiles.
    whole: dict[tuple[int, int], list[int]] = {}  # (owner, block) -> tokens that see it whole
    partial: dict[tuple[int, int], list[int]] = {}  # (segment, block) -> tokens that see part of it
    for sid, idx in by_seg.items():
        owners = []  # (segment, first block, end block), root first; sid owns every later block
        for c in cache.chain(sid):
            seg = cache.segments[c]
            if seg.start is not None:
                owners.append((c, seg.start // B, seg.end // B if c != sid else 1 << 62))
        for i in idx:
            whole_blocks, cut_blocks = visible_blocks(pos_list[i], window)
            for c, a, e in owners:
                for b in range(max(a, whole_blocks.start), min(e, whole_blocks.stop)):
                    whole.setdefault((c, b), []).append(i)
            for b in cut_blocks:
                partial.setdefault((sid, b), []).append(i)

    chain_slots: dict[int, list[int]] = {}

    def keys_of(sid: int, b: int) -> list[int]:
        if sid not in chain_slots:
            chain_slots[sid] = cache.chain_slots(sid)
        k = chain_slots[sid][b * B:b * B + B]
        return k + [PAD_SLOT] * (B - len(k))

    def items(groups: dict[tuple[int, int], list[int]], t: int, batch: int, masked: bool) -> Items:
        """Every group's items in a few whole-pass array ops on the host (numpy), then one transfer each:
        per group, its tokens' query rows padded to whole tiles with the spare row, each tile against the
        group's key block, for every KV head (head-major), the groups sorted by block."""
        order = sorted(groups, key=lambda key: key[1])  # by block; stable, so a block's groups keep their order
        ng = len(order)
        n_rows = np.fromiter((len(groups[key]) * G for key in order), dtype=np.int64, count=ng)  # (ng,)
        nt = -(-n_rows // t)  # tiles per group
        tok = np.fromiter(itertools.chain.from_iterable(groups[key] for key in order), dtype=np.int64)
        r = (tok[:, None] * G + np.arange(G)).reshape(-1)  # query rows of every group's tokens, in order
        grp = np.repeat(np.arange(ng), n_rows)  # the group of each of them
        tile_start = np.cumsum(nt) - nt  # each group's first tile
        tiles_flat = np.full(int(nt.sum()) * t, spare, dtype=np.int64)
        tiles_flat[tile_start[grp] * t + np.arange(r.size) - (np.cumsum(n_rows) - n_rows)[grp]] = r
        per = hkv * nt  # items per group: its tiles for every KV head
        ig = np.repeat(np.arange(ng), per)  # the group of each item
        w = np.arange(ig.size) - (np.cumsum(per) - per)[ig]  # the item's index within its group
        head, tile = w // nt[ig], tile_start[ig] + w % nt[ig]
        key_slots = np.array([keys_of(sid, b) for sid, b in order], dtype=np.int64).reshape(ng, B)  # (ng, B)
        blocks = np.array([b for _, b in order], dtype=np.int64)
        pad = (-ig.size) % batch  # dummy items: the spare row against the padding slot
        rows_t = np.concatenate([tiles_flat.reshape(-1, t)[tile] + (head * stride)[:, None],
                                 np.full((pad, t), spare, dtype=np.int64)])  # (I, T)
        keys_t = np.concatenate([key_slots[ig] + (head * s)[:, None], np.full((pad, B), PAD_SLOT, dtype=np.int64)])
        item_blocks = np.concatenate([blocks[ig], np.full(pad, blocks[-1] if ng else 0, dtype=np.int64)])
        bounds = [0, *(np.flatnonzero(np.diff(item_blocks)) + 1).tolist(), int(item_blocks.size)]
        hidden = None
        if masked:
            key_pos = np.where(key_slots == PAD_SLOT, NEVER, blocks[:, None] * B + np.arange(B))  # (ng, B)
            kp = np.concatenate([key_pos[ig], np.full((pad, B), NEVER, dtype=np.int64)])[:, None, :]  # (I, 1, B)
            row_pos = np.full((hkv, stride), -1, dtype=np.int64)  # spare and padded rows: position -1
            row_pos[:, :len(pos_list) * G] = np.repeat(np.asarray(pos_list, dtype=np.int64), G)
            rp = row_pos.reshape(-1)[rows_t][:, :, None]  # (I, T, 1)
            hidden_np = kp > rp  # (I, T, B)
            if window is not None:  # cut on the left too (padding keys, at NEVER, stay hidden)
                hidden_np |= kp <= rp - window
            hidden = torch.from_numpy(hidden_np).to(device)
        return Items(torch.from_numpy(rows_t).to(device), torch.from_numpy(keys_t).to(device), hidden, bounds)

    plan = AttentionPlan(positions=positions, group_size=G,
                         whole=items(whole, tiles.full, tiles.full_batch, masked=False),
                         partial=items(partial, tiles.part, tiles.part_batch, masked=True))
    if dense:
        chains = {sid: cache.chain(sid) for sid in by_seg}
        plan.visible = _dense_visibility(cache, chains, seg_list, positions.cpu(), window).to(device)
    return plan


def _dense_visibility(cache: KVCache, chains: dict[int, list[int]], seg_list: list[int],
                      positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(N, S) bool: the segment rule (and the window) written out over every cache slot."""
    s = cache.k.shape[2]
    slot_seg = torch.full((s,), -1, dtype=torch.long)
    slot_pos = torch.full((s,), -1, dtype=torch.long)
    for sid, seg in cache.segments.items():
        if seg.slots:
            idx = torch.tensor(seg.slots, dtype=torch.long)
            slot_seg[idx] = sid
            slot_pos[idx] = torch.arange(seg.start, seg.end)
    in_chain = {sid: torch.isin(slot_seg, torch.tensor(ch)) for sid, ch in chains.items()}
    rows = torch.stack([in_chain[sid] for sid in seg_list])  # (N, S)
    seen = rows & (slot_pos[None, :] <= positions[:, None]) & (slot_seg[None, :] >= 0)
    return seen if window is None else seen & (slot_pos[None, :] > positions[:, None] - window)


def _add_rows(out: torch.Tensor, rows: torch.Tensor, terms: torch.Tensor, index_add: bool) -> None:
    """out[rows[i]] += terms[i], each real row at most once per call (the spare row takes the rest).

    Either way it is one IEEE addition per element, so the bits do not depend on which way: `index_add_`
    is one launch (a GPU's choice, `Tiles.index_add`), but on a CPU with 2 threads it runs ~1000x slower
    than a gather, an add and a plain `index_put_` (measured: 75 ms against 0.07 ms for 2,000 rows of 65).
    """
    if index_add:
        out.index_add_(0, rows, terms)
    else:
        out.index_put_((rows,), out.index_select(0, rows).add_(terms))


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                      tiles: Tiles) -> torch.Tensor:
    """q: (Hkv, R, D) query rows; k_cache, v_cache: (Hkv, S, D). Returns (Hkv, R, D), at least float32.

    Pass 1 finds each row's exact maximum over all its items; pass 2 takes exp(score - max), its sum and its
    weighted values per item, and adds each row's blocks onto zero in block order (`_add_rows` per block:
    a row meets each block once, so every call adds one term to it). Items are processed in chunks of at
    most `Tiles.*_chunk` (all at once when a kind has at most `Tiles.keep`); with more than one chunk, pass
    2 computes the scores again (the same products, the same bits) rather than hold them all.
    """
    hkv, r, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax arithmetic: float32 for 16-bit models
    qf = torch.cat([q.to(acc) * (1.0 / math.sqrt(d)), q.new_zeros(hkv, 1, d, dtype=acc)], dim=1).view(-1, d)
    kf, vf = k_cache.reshape(-1, d), v_cache.reshape(-1, d)  # (Hkv * S, D): flat slots, a view
    kinds = [(items, batch, items.count if 0 < items.count <= tiles.keep else chunk)  # see Tiles.keep
             for items, batch, chunk in ((plan.whole, tiles.full_batch, tiles.full_chunk),
                                         (plan.partial, tiles.part_batch, tiles.part_chunk))]

    def gather(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """src rows at idx (I, n): (I, n, D). index_select copies whole rows (a plain src[idx] goes by element)."""
        return src.index_select(0, idx.reshape(-1)).view(*idx.shape, src.shape[-1])

    def scores(items: Items, lo: int, hi: int, batch: int) -> torch.Tensor:
        hidden = None if items.hidden is None else items.hidden[lo:hi]
        return _block_scores(gather(qf, items.rows[lo:hi]), gather(kf, items.keys[lo:hi]).to(acc), batch, hidden)

    M = qf.new_full((qf.shape[0],), float("-inf"))  # pass 1: each row's maximum
    kept = []
    for items, batch, chunk in kinds:
        s = None
        for lo in range(0, items.count, chunk):
            s = scores(items, lo, min(lo + chunk, items.count), batch)
            M.scatter_reduce_(0, items.rows[lo:lo + chunk].reshape(-1), s.amax(dim=-1).reshape(-1), "amax")
        kept.append(s if items.count <= chunk else None)
    m = _finite(M)

    O = qf.new_zeros(qf.shape[0], d + 1)  # pass 2: weighted values and, in column D, the softmax sum
    for (items, batch, chunk), s_kept in zip(kinds, kept):
        for lo in range(0, items.count, chunk):
            hi = min(lo + chunk, items.count)
            s = s_kept if s_kept is not None else scores(items, lo, hi, batch)
            rows = items.rows[lo:hi]
            e = s.sub_(m.index_select(0, rows.reshape(-1)).view(*rows.shape, 1)).exp_()  # (I, T, B); hidden: 0
            o = torch.cat([batched_products(e, gather(vf, items.keys[lo:hi]).to(acc), batch),
                           batched_row_sums(e, batch)], dim=-1)  # (I, T, D + 1)
            for a, b in zip(items.bounds, items.bounds[1:]):  # one block after another
                a, b = max(a, lo), min(b, hi)
                if a < b:
                    _add_rows(O, rows[a - lo:b - lo].reshape(-1), o[a - lo:b - lo].view(-1, d + 1), tiles.index_add)
    O = O.view(hkv, r + 1, d + 1)[:, :r]
    # Padded token rows saw nothing (sum 0): the floor keeps them 0 rather than 0/0.
    return O[..., :d] / O[..., d:].clamp_min(torch.finfo(acc).tiny)


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
