"""Who sees whom, and the batch-invariant attention kernel.

Notation for tensor shapes: N new tokens in this forward pass, H query heads, Hkv key/value heads,
G = H / Hkv query heads per KV head, D head dim, S cache slots, R = N * G query rows per KV head,
B keys per block, T query rows per tile, W work items, NB blocks per row (a power of two).

The segment rule (cache.py has the segments). A query token q sees key token k when

    visible(q, k) = k.segment in chain(q.segment)  and  k.position <= q.position

where chain(s) is s and its ancestors. A question sees its whole document and its own earlier tokens;
a document never sees its questions; unrelated prompts (separate roots) never see each other.

Why not one masked softmax over the packed sequence: a reduction over a longer row with -inf holes uses
another summation order than the reduction over the question's own prompt, and the last bits differ
(NOTES.md). Instead each query's keys are taken in *logical* order (its chain, by position) and cut into
blocks at positions 0, B, 2B, ...; each block is reduced with fixed-shape kernels against the row's exact
maximum, and the blocks' sums are added in a fixed binary tree over block index. All of this depends only on the query's own
logical sequence, so a question gets the same bits packed with a thousand others as alone.

Sharing (Hydragen): all queries that see block b of the same owner segment (say, the 64 questions of a
document, each decoding one token) are gathered into one group and multiply that block's keys in one
matrix-matrix product: the document's keys are read once per step, not once per question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import PAD_SLOT, KVCache

KEY_BLOCK = 64  # B: keys per block, aligned to logical positions
# T: query rows per matrix product. A query sees every key of the blocks before its own ("full" blocks,
# shared by many queries: big tiles) and some keys of the block holding its position ("partial": small
# tiles, as often only one token's G heads need it). Which kind a (query, block) pair is depends only on
# the query's position, never on the batch, so each pair always meets the same kernel shape.
FULL_TILE = 64
PARTIAL_TILE = 8


@dataclass
class WorkItems:
    """Work item w multiplies query rows q_rows[w] by the keys in k_slots[w] (one fixed tile shape)."""

    q_rows: torch.Tensor  # (W, T) row index into the R query rows; R is the dummy (padding) row
    k_slots: torch.Tensor  # (W, B) cache slots, PAD_SLOT where the block has no key
    mask: torch.Tensor | None  # (W, T, B) visible(query row, key); None: all visible (full blocks)
    block: torch.Tensor  # (W,) block index b of the work item's keys


@dataclass
class AttentionPlan:
    """What attention needs for one forward pass, shared by all layers."""

    slots: torch.Tensor  # (N,) cache slot of each new token
    positions: torch.Tensor  # (N,)
    group_size: int  # G
    items: list[WorkItems]  # one list per tile shape
    n_blocks: int  # NB: the most blocks any row has
    # Dense masked path (negative control): visible cache slots of each token.
    visible: torch.Tensor | None = None  # (N, S) bool


def plan_attention(cache: KVCache, segments: torch.Tensor, positions: torch.Tensor, group_size: int,
                   n_rows: int, dense: bool = False) -> AttentionPlan:
    """Allocate cache slots for the new tokens and lay out the blocked attention work.

    `n_rows` >= N is the padded token count the model runs (model.py says why); the query row of padded
    token n_rows is the dummy row that fills the last tile of each group.
    """
    device = cache.k.device
    slots = cache.append(segments, positions)
    seg_list = segments.tolist()
    pos_list = positions.tolist()
    n = len(seg_list)
    B, G = KEY_BLOCK, group_size

    # New tokens of each segment, in position order (append checked they are consecutive).
    by_seg: dict[int, list[int]] = {}
    for i, sid in enumerate(seg_list):
        by_seg.setdefault(sid, []).append(i)

    # Group (owner segment, block b) -> token indices. For a query at position p and a block b <= p // B,
    # the block's keys are the chain's tokens at positions [bB, bB + B) up to p. Every query whose chain
    # holds the same tokens there shares the group; the owner is the chain segment holding position
    # min(bB + B - 1, p), the deepest segment reaching into the block.
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    chains: dict[int, list[tuple[int, int, int]]] = {}
    for sid, idx in by_seg.items():
        chain = [(c, cache.segments[c].start, cache.segments[c].end) for c in cache.chain(sid)]
        chains[sid] = chain
        first = pos_list[idx[0]]  # positions are first .. first + len(idx) - 1
        idx_t = torch.tensor(idx, dtype=torch.long)
        c_i = 0
        for b in range(pos_list[idx[-1]] // B + 1):
            lo, hi = b * B, b * B + B - 1
            if hi < first:  # every new query of sid is past this block: owner holds position hi
                while chain[c_i][2] <= hi:
                    c_i += 1
                owner, members = chain[c_i][0], idx_t
            else:  # the block reaches this call's new tokens: owner is sid itself
                owner, members = sid, idx_t[max(0, lo - first):]
            groups.setdefault((owner, b), []).append(members)

    # Lay each group out as work items of T query rows against one block of B keys.
    pos_t = torch.full((n_rows + 1,), -1, dtype=torch.long)  # padded and dummy tokens: position -1
    pos_t[:n] = positions
    chain_slot_cache: dict[int, torch.Tensor] = {}
    tiles = {FULL_TILE: ([], [], [], []), PARTIAL_TILE: ([], [], [], [])}  # T -> rows, keys, key pos, block
    for (owner, b), members in groups.items():
        tokens = torch.cat(members)
        if owner not in chain_slot_cache:
            chain_slot_cache[owner] = torch.tensor(cache.chain_slots(owner), dtype=torch.long)
        keys = chain_slot_cache[owner][b * B:(b + 1) * B]
        keys = torch.cat([keys, torch.full((B - keys.numel(),), PAD_SLOT, dtype=torch.long)])
        kp = torch.arange(b * B, b * B + B)
        kp[(keys == PAD_SLOT)] = torch.iinfo(torch.long).max  # padding is never visible
        full = pos_t[tokens] >= b * B + B - 1
        for tile, part in ((FULL_TILE, tokens[full]), (PARTIAL_TILE, tokens[~full])):
            if not part.numel():
                continue
            rows = (part[:, None] * G + torch.arange(G)).reshape(-1)  # (r,) query rows of these tokens
            pad = (-rows.numel()) % tile
            rows = torch.cat([rows, torch.full((pad,), n_rows * G, dtype=torch.long)]).view(-1, tile)
            acc = tiles[tile]
            acc[0].append(rows)
            acc[1].append(keys.expand(rows.shape[0], B))
            acc[2].append(kp.expand(rows.shape[0], B))
            acc[3].append(torch.full((rows.shape[0],), b, dtype=torch.long))
    items = []
    for tile, (rows, keys, kpos, blocks) in tiles.items():
        if not rows:
            continue
        rows_t, kpos_t = torch.cat(rows), torch.cat(kpos)
        mask = None
        if tile == PARTIAL_TILE:  # full blocks are wholly visible; their dummy rows are zeros, harmless
            row_pos = pos_t[torch.div(rows_t, G, rounding_mode="floor")]  # (W, T)
            mask = (kpos_t[:, None, :] <= row_pos[:, :, None]).to(device)  # (W, T, B)
        items.append(WorkItems(rows_t.to(device), torch.cat(keys).to(device), mask, torch.cat(blocks).to(device)))
    n_blocks = max(pos_list) // B + 1

    visible = None
    if dense:
        visible = _dense_visibility(cache, chains, seg_list, positions.cpu())

    return AttentionPlan(slots=slots, positions=positions, group_size=G, items=items, n_blocks=n_blocks,
                         visible=None if visible is None else visible.to(device))


def _dense_visibility(cache: KVCache, chains: dict[int, list[tuple[int, int, int]]], seg_list: list[int],
                      positions: torch.Tensor) -> torch.Tensor:
    """(N, S) bool: the segment rule written out over every cache slot."""
    s = cache.k.shape[2]
    slot_seg = torch.full((s,), -1, dtype=torch.long)
    slot_pos = torch.full((s,), -1, dtype=torch.long)
    for sid, seg in cache.segments.items():
        if seg.slots:
            idx = torch.tensor(seg.slots, dtype=torch.long)
            slot_seg[idx] = sid
            slot_pos[idx] = torch.arange(seg.start, seg.end)
    in_chain = {sid: torch.isin(slot_seg, torch.tensor([c for c, _, _ in ch])) for sid, ch in chains.items()}
    rows = torch.stack([in_chain[sid] for sid in seg_list])  # (N, S)
    return rows & (slot_pos[None, :] <= positions[:, None]) & (slot_seg[None, :] >= 0)


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: AttentionPlan) -> torch.Tensor:
    """q: (Hkv, R, D) query rows; k_cache, v_cache: (Hkv, S, D). Returns (Hkv, R, D), at least float32."""
    hkv, r, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax arithmetic: float32 for 16-bit models
    NB = plan.n_blocks
    # Row r is the dummy; the table gets a whole extra tile of rows so that its size stays a multiple of 64
    # (no scalar tails in exp below; see model.py).
    q = torch.cat([q.to(acc) * (1.0 / math.sqrt(d)), q.new_zeros(hkv, 1, d, dtype=acc)], dim=1)
    r_tab = r + 64

    # Pass 1: scores of every (row, block) pair, and each row's maximum over all its blocks. A maximum
    # is exact in any order, so scatter_reduce may combine the blocks however it likes.
    scores = []
    M = q.new_full((hkv, r_tab), float("-inf"))
    for it in plan.items:
        W, T = it.q_rows.shape
        B = it.k_slots.shape[1]
        qw = q[:, it.q_rows].view(hkv * W, T, d)  # (Hkv*W, T, D)
        kw = k_cache[:, it.k_slots].to(acc).view(hkv * W, B, d)  # (Hkv*W, B, D)
        s = torch.bmm(qw, kw.transpose(1, 2)).view(hkv, W, T, B)  # q k^T over one block: fixed shapes
        if it.mask is not None:
            s.masked_fill_(~it.mask, float("-inf"))
        M.scatter_reduce_(1, it.q_rows.reshape(1, -1).expand(hkv, -1), s.amax(dim=-1).view(hkv, -1), "amax")
        scores.append(s)

    # Pass 2: per block, exp(s - row max), its sum and its weighted values, into a (rows, blocks) table.
    # Blocks a row does not have stay zero.
    L = q.new_zeros((hkv, r_tab * NB))
    O = q.new_zeros((hkv, r_tab * NB, d))
    m_safe = _finite(M)
    for it, s in zip(plan.items, scores):
        W, T, B = s.shape[1], s.shape[2], s.shape[3]
        e = s.sub_(m_safe[:, it.q_rows][..., None]).exp_()  # (Hkv, W, T, B); masked keys: exp(-inf) = 0
        vw = v_cache[:, it.k_slots].to(acc).view(hkv * W, B, d)
        flat = (it.q_rows * NB + it.block[:, None]).reshape(-1)  # (W*T,) table cells
        L[:, flat] = e.sum(dim=-1).view(hkv, -1)
        O[:, flat] = torch.bmm(e.view(hkv * W, T, B), vw).view(hkv, -1, d)
    L, O = L.view(hkv, r_tab, NB), O.view(hkv, r_tab, NB, d)

    # Sum over blocks in a fixed binary tree over block index: (0,1), (2,3), ... then pairs of those; an
    # odd one out passes up unchanged, as if added to a zero. Blocks past a row's last one are zeros too,
    # and x + 0 = x, so a longer neighbour in the batch (a larger NB) cannot change a row's result.
    while L.shape[-1] > 1:
        half = L.shape[-1] // 2
        odd_l, odd_o = L[..., 2 * half:], O[..., 2 * half:, :]  # empty when even
        L = torch.cat([L[..., 0:2 * half:2] + L[..., 1:2 * half:2], odd_l], dim=-1)
        O = torch.cat([O[..., 0:2 * half:2, :] + O[..., 1:2 * half:2, :], odd_o], dim=-2)
    l_out = L[:, :r, 0, None]
    # Padded token rows saw nothing (l = 0): give them zeros rather than 0/0.
    return torch.where(l_out > 0, O[:, :r, 0] / l_out, torch.zeros_like(O[:, :r, 0]))


def _finite(m: torch.Tensor) -> torch.Tensor:
    """Replace -inf maxima (nothing visible) by 0, so that exp(-inf - 0) = 0 rather than NaN."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


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
