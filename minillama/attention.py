"""Who sees whom, and the batch-invariant attention kernel.

Notation for tensor shapes: N new tokens in this forward pass, H query heads, Hkv key/value heads,
G = H / Hkv query heads per KV head, D head dim, S cache slots, R = N * G query rows per KV head,
B keys per block, T query rows per tile, nt tiles and nb blocks of a run, W items of a batch.

The segment rule (cache.py has the segments). A query token q sees key token k when

    visible(q, k) = k.segment in chain(q.segment)  and  k.position <= q.position

where chain(s) is s and its ancestors. A question sees its whole document and its own earlier tokens;
a document never sees its questions; unrelated prompts (separate roots) never see each other.

Why not one masked softmax over the packed sequence: a reduction over a longer row with -inf holes uses
another summation order than the reduction over the question's own prompt, and the last bits differ
(NOTES.md). Instead each query's keys are taken in *logical* order (its chain, by position) and cut into
blocks at positions 0, B, 2B, ...; each block is reduced with fixed-shape products against the row's
exact maximum, and the blocks' sums are added one after another in block order. All of this depends only
on the query's own logical sequence, so a question gets the same bits packed with a thousand others as
alone.

Sharing (Hydragen): all queries that see the same whole blocks of one segment (say, the 64 questions of a
document, each decoding one token) form one run, and every tile of their query rows meets every block of
the document's keys in matrix-matrix products: the document's keys are read once per step, in place, not
once per question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import PAD_SLOT, KVCache

KEY_BLOCK = 64  # B: keys per block, aligned to logical positions
# T: query rows per matrix product. A query sees every key of the blocks before its own ("whole" blocks,
# shared by many queries: big tiles, one Run) and some keys of the block holding its position ("partial":
# small tiles, as often only one token's G heads need it). Which kind a (query, block) pair is depends only
# on the query's position, never on the batch, so each pair always meets the same kernel shape.
FULL_TILE = 64
PARTIAL_TILE = 8
# A run of fewer (tile, block) pairs than this goes into per-block item batches instead: 64 questions that
# have each filled a block of their own make 64 one-pair runs, better done as one batched product.
SMALL_RUN = 8
# Masked items of one segment's block whose keys are gathered once for all of them, from this many on.
SHARED_ITEMS = 4


@dataclass
class Run:
    """Query rows that all see the same whole key blocks a .. a + nb - 1: one Hydragen product.

    Every (row tile, block) pair is a (FULL_TILE, D) x (D, KEY_BLOCK) product. The query tiles are gathered
    once for all the blocks, and the keys once for all the tiles (not at all when they sit in consecutive
    cache slots, as a document's do): a document's keys are read once per step for all its questions.
    """

    rows: torch.Tensor  # (nt * T,) query rows, padded with the dummy row R
    first_block: int  # a
    n_blocks: int  # nb
    k_slots: torch.Tensor  # (nb * B,) cache slots of the keys, block after block
    k_start: int | None  # first slot when k_slots are consecutive: read the cache in place


@dataclass
class Items:
    """Item w multiplies query rows q_rows[w] by the keys of one block: a batch of single (tile, block) pairs.

    Used for a query's own block (masked, PARTIAL_TILE rows) and for runs too small to be worth their own
    products (one FULL_TILE tile against a block or two: a question that has filled a block of its own).
    """

    q_rows: torch.Tensor  # (W, T) row index into the R query rows; R is the dummy (padding) row
    k_slots: torch.Tensor  # (W, B) cache slots, PAD_SLOT where the block has no key
    mask: torch.Tensor | None  # (W, T, B) visible(query row, key); None: whole blocks, all visible
    block: torch.Tensor  # (W,) block index b of the item's keys


@dataclass
class AttentionPlan:
    """What attention needs for one forward pass, shared by all layers."""

    slots: torch.Tensor  # (N,) cache slot of each new token
    positions: torch.Tensor  # (N,)
    group_size: int  # G
    # Whole blocks, sorted by first block (a row's works cover disjoint block ranges, so each row meets its
    # blocks in increasing order); item batches here hold one block index each.
    work: list[Run | Items]
    partial: Items | None  # a row's own, masked block: its last; at most one item per row
    # The same for the tokens of one segment in one block when they are many (a prefill): one Items per
    # block, whose items all read that block's keys, gathered once (k_slots is (1, B)).
    partial_groups: list[Items] = field(default_factory=list)
    # Dense masked path (negative control): visible cache slots of each token.
    visible: torch.Tensor | None = None  # (N, S) bool


def plan_attention(cache: KVCache, segments: torch.Tensor, positions: torch.Tensor, group_size: int,
                   n_rows: int, dense: bool = False) -> AttentionPlan:
    """Allocate cache slots for the new tokens and lay out the blocked attention work.

    `n_rows` >= N is the padded token count the model runs (model.py says why); the query row of padded
    token n_rows is the dummy row that fills the last tile of a run or item.
    """
    device = cache.k.device
    slots = cache.append(segments, positions)
    seg_list = segments.tolist()
    pos_list = positions.tolist()
    B, G = KEY_BLOCK, group_size
    dummy = n_rows * G

    # New tokens of each segment, in position order (append checked they are consecutive).
    by_seg: dict[int, list[int]] = {}
    for i, sid in enumerate(seg_list):
        by_seg.setdefault(sid, []).append(i)

    # A query at position p sees f = (p + 1) // B whole blocks, 0 .. f - 1, and, unless p ends a block, part
    # of block f. Whole block b belongs to the chain segment holding its last position bB + B - 1 (its
    # "owner"): the queries of all segments under that owner see the same keys there. So the whole blocks
    # of a query split into one range per chain segment, (owner, a, e); the queries with the same range
    # form one Run. The range depends on the query's position and chain, never on the batch.
    runs: dict[tuple[int, int, int], list[torch.Tensor]] = {}  # (owner, a, e) -> tokens
    partial: dict[tuple[int, int], torch.Tensor] = {}  # (segment, block) -> tokens that see part of it
    for sid, idx in by_seg.items():
        chain = cache.chain(sid)
        first, last = pos_list[idx[0]], pos_list[idx[-1]]  # positions are first .. last, consecutive
        idx_t = torch.tensor(idx, dtype=torch.long)
        owned = []  # (owner, first block, end block) from the root down; sid owns every later block
        for c in chain:
            seg = cache.segments[c]
            if seg.start is None:  # no tokens: owns nothing
                continue
            owned.append((c, seg.start // B, seg.end // B if c != sid else 1 << 62))
        for f in range((first + 1) // B, (last + 1) // B + 1):
            lo, hi = max(first, f * B - 1), min(last, f * B + B - 2)  # positions with (p + 1) // B == f
            if lo > hi:
                continue
            tokens = idx_t[lo - first:hi - first + 1]
            for c, a, e in owned:
                if a < min(e, f):
                    runs.setdefault((c, a, min(e, f)), []).append(tokens)
            part = tokens[1:] if lo == f * B - 1 else tokens  # the query at fB - 1 saw block f - 1 whole
            if part.numel():
                partial[(sid, f)] = part

    chain_slots: dict[int, torch.Tensor] = {}

    def keys_of(owner: int, a: int, e: int) -> torch.Tensor:
        if owner not in chain_slots:
            chain_slots[owner] = torch.tensor(cache.chain_slots(owner), dtype=torch.long)
        return chain_slots[owner][a * B:e * B]

    def tiles(tokens: torch.Tensor, tile: int) -> torch.Tensor:
        rows = (tokens[:, None] * G + torch.arange(G)).reshape(-1)  # query rows of these tokens
        return torch.cat([rows, torch.full(((-rows.numel()) % tile,), dummy, dtype=torch.long)])

    work: list[tuple[int, Run | Items]] = []
    small: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # block -> tiles, keys
    for (owner, a, e), members in runs.items():
        rows = tiles(torch.cat(members), FULL_TILE)
        k = keys_of(owner, a, e)
        if len(rows) // FULL_TILE * (e - a) < SMALL_RUN:  # into per-block item batches
            for j in range(e - a):
                acc = small.setdefault(a + j, ([], []))
                acc[0].append(rows.view(-1, FULL_TILE))
                acc[1].append(k[j * B:(j + 1) * B].expand(len(rows) // FULL_TILE, B))
            continue
        consecutive = bool((k[1:] - k[:-1] == 1).all()) and int(k[0]) > PAD_SLOT
        work.append((a, Run(rows.to(device), a, e - a, k.to(device), int(k[0]) if consecutive else None)))
    for b, (rows, keys) in small.items():
        rows_t = torch.cat(rows)
        work.append((b, Items(rows_t.to(device), torch.cat(keys).to(device), None,
                              torch.full((rows_t.shape[0],), b, dtype=torch.long))))
    work.sort(key=lambda bw: bw[0])

    pos_t = torch.full((n_rows + 1,), -1, dtype=torch.long)  # padded and dummy tokens: position -1
    pos_t[:len(pos_list)] = positions

    def masked_items(groups: list[tuple[int, torch.Tensor, torch.Tensor]], shared: bool) -> Items:
        """Items of (block b, keys, tokens) groups; `shared`: one group whose keys all its items use."""
        rows, keys, kpos, blocks = [], [], [], []
        for b, k, tokens in groups:
            kp = torch.arange(b * B, b * B + B)
            kp[k == PAD_SLOT] = torch.iinfo(torch.long).max  # padding is never visible
            r = tiles(tokens, PARTIAL_TILE).view(-1, PARTIAL_TILE)
            rows.append(r)
            keys.append(k[None] if shared else k.expand(r.shape[0], B))
            kpos.append(kp.expand(r.shape[0], B))
            blocks.append(torch.full((r.shape[0],), b, dtype=torch.long))
        rows_t, kpos_t = torch.cat(rows), torch.cat(kpos)
        row_pos = pos_t[torch.div(rows_t, G, rounding_mode="floor")]  # (W, T)
        mask = kpos_t[:, None, :] <= row_pos[:, :, None]  # (W, T, B)
        return Items(rows_t.to(device), torch.cat(keys).to(device), mask.to(device), torch.cat(blocks))

    lone, shared_groups = [], []
    for (sid, b), tokens in partial.items():
        k = keys_of(sid, b, b + 1)
        k = torch.cat([k, torch.full((B - k.numel(),), PAD_SLOT, dtype=torch.long)])
        many = tokens.numel() * G >= SHARED_ITEMS * PARTIAL_TILE  # a prefill's block: its keys read once
        (shared_groups if many else lone).append((b, k, tokens))
    part = masked_items(lone, shared=False) if lone else None
    part_groups = [masked_items([g], shared=True) for g in shared_groups]

    visible = None
    if dense:
        chains = {sid: cache.chain(sid) for sid in by_seg}
        visible = _dense_visibility(cache, chains, seg_list, positions.cpu())

    return AttentionPlan(slots=slots, positions=positions, group_size=G, work=[w for _, w in work], partial=part,
                         partial_groups=part_groups, visible=None if visible is None else visible.to(device))


def _dense_visibility(cache: KVCache, chains: dict[int, list[int]], seg_list: list[int],
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
    in_chain = {sid: torch.isin(slot_seg, torch.tensor(ch)) for sid, ch in chains.items()}
    rows = torch.stack([in_chain[sid] for sid in seg_list])  # (N, S)
    return rows & (slot_pos[None, :] <= positions[:, None]) & (slot_seg[None, :] >= 0)


def _run_keys(cache: torch.Tensor, run: Run, dtype: torch.dtype) -> torch.Tensor:
    """(Hkv, nb, B, D): the run's keys (or values), in place when their slots are consecutive."""
    hkv, _, d = cache.shape
    if run.k_start is not None:
        k = cache[:, run.k_start:run.k_start + run.n_blocks * KEY_BLOCK]
    else:
        k = cache[:, run.k_slots]
    return k.to(dtype).view(hkv, run.n_blocks, KEY_BLOCK, d)


def _pairs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out[h, t, j] = a[h, t] @ b[h, j]: every row tile t against every block j. Returns (H, nt, nb, T, N).

    a is (H, nt, T, K), one matrix per tile (queries), or (H, nt, nb, T, K), one per pair (probabilities);
    b is (H, nb, K, N). Every product is one (T, K) x (K, N) matrix product, whatever nt and nb: batched
    over the longer axis, a tile's queries or a block's keys repeated there by a stride-0 view (no copy),
    in a loop over the shorter axis.
    """
    h, nt, nb, t, n = a.shape[0], a.shape[1], b.shape[1], a.shape[-2], b.shape[3]
    k = a.shape[-1]
    per_pair = a.dim() == 5
    if nt <= nb:
        out = a.new_empty(h, nt, nb, t, n)
        for i in range(h):
            for j in range(nt):
                torch.bmm(a[i, j] if per_pair else a[i, j].expand(nb, t, k), b[i], out=out[i, j])
        return out
    out = a.new_empty(h, nb, nt, t, n)
    for i in range(h):
        for j in range(nb):
            torch.bmm(a[i, :, j] if per_pair else a[i], b[i, j].expand(nt, k, n), out=out[i, j])
    return out.transpose(1, 2)


# (tile, block) pairs per chunk, over all KV heads: a chunk's scores (CHUNK_PAIRS x 64 x 64 floats, 16 MiB)
# stay in the CPU's cache through exp, sum and the second product. Chunking never changes a bit: maxima
# are exact in any order, and each row's blocks are still added one after another in block order.
CHUNK_PAIRS = 1024


def _chunks(run: Run, hkv: int) -> list[tuple[slice, slice]]:
    """(tiles, blocks) slices covering the run, blocks in order within each tile range."""
    nt, nb = len(run.rows) // FULL_TILE, run.n_blocks
    per = max(1, CHUNK_PAIRS // hkv)
    cb = min(nb, per)
    ct = max(1, min(nt, per // cb))
    return [(slice(t, min(t + ct, nt)), slice(b, min(b + cb, nb))) for t in range(0, nt, ct) for b in range(0, nb, cb)]


def _item_scores(q: torch.Tensor, k_cache: torch.Tensor, items: Items, dtype: torch.dtype) -> torch.Tensor:
    """(Hkv, W, T, B) scores of a batch of items, -inf where masked."""
    hkv, d = q.shape[0], q.shape[2]
    W, T = items.q_rows.shape
    if items.k_slots.shape[0] == 1:  # one block's keys for every item: a stride-0 view, per KV head
        qw = q[:, items.q_rows]  # (Hkv, W, T, D)
        kt = k_cache[:, items.k_slots[0]].to(dtype).transpose(1, 2).contiguous()  # (Hkv, D, B)
        s = qw.new_empty(hkv, W, T, KEY_BLOCK)
        for h in range(hkv):
            torch.bmm(qw[h], kt[h].expand(W, d, KEY_BLOCK), out=s[h])
    else:
        qw = q[:, items.q_rows].view(hkv * W, T, d)
        kw = k_cache[:, items.k_slots].to(dtype).view(hkv * W, KEY_BLOCK, d)
        s = torch.bmm(qw, kw.transpose(1, 2)).view(hkv, W, T, KEY_BLOCK)
    return s if items.mask is None else s.masked_fill_(~items.mask, float("-inf"))


def _item_values(e: torch.Tensor, v_cache: torch.Tensor, items: Items, dtype: torch.dtype) -> torch.Tensor:
    """(Hkv, W, T, D): each item's probabilities e (Hkv, W, T, B) times its block's values."""
    hkv, W, T, B = e.shape
    d = v_cache.shape[-1]
    if items.k_slots.shape[0] == 1:
        vb = v_cache[:, items.k_slots[0]].to(dtype)  # (Hkv, B, D)
        out = e.new_empty(hkv, W, T, d)
        for h in range(hkv):
            torch.bmm(e[h], vb[h].expand(W, B, d), out=out[h])
        return out
    vw = v_cache[:, items.k_slots].to(dtype).view(hkv * W, B, d)
    return torch.bmm(e.view(hkv * W, T, B), vw).view(hkv, W, T, d)


def blocked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: AttentionPlan) -> torch.Tensor:
    """q: (Hkv, R, D) query rows; k_cache, v_cache: (Hkv, S, D). Returns (Hkv, R, D), at least float32.

    Per query row: pass 1 finds the exact maximum score over all its keys (a maximum is exact in any order);
    pass 2 takes, block by block, exp(score - max), its sum and its weighted values, and adds the blocks up
    one after another in block order onto zero: 0 + b0 + b1 + b2 + ...: the same additions, in the same
    order, however the row's blocks were split into runs, items and chunks, and whatever else shares the
    pass. Pass 2 computes a big run's scores again rather than keep them all: recomputing gives the same bits.
    """
    hkv, r, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax arithmetic: float32 for 16-bit models
    T, B = FULL_TILE, KEY_BLOCK
    q = torch.cat([q.to(acc) * (1.0 / math.sqrt(d)), q.new_zeros(hkv, 1, d, dtype=acc)], dim=1)  # row r: dummy

    # Pass 1: each row's maximum score over all its blocks.
    M = q.new_full((hkv, r + 1), float("-inf"))
    # Keys transposed to (D, B) blocks, the layout the products read fastest; runs reading the same
    # consecutive slots (a document's, from its first block) share one copy.
    in_place: dict[int, int] = {}
    for w in plan.work:
        if isinstance(w, Run) and w.k_start is not None:
            in_place[w.k_start] = max(in_place.get(w.k_start, 0), w.n_blocks)
    shared_kt = {start: k_cache[:, start:start + nb * B].to(acc).view(hkv, nb, B, d).transpose(-1, -2).contiguous()
                 for start, nb in in_place.items()}
    kept = []
    for w in plan.work:
        if isinstance(w, Items):
            s = _item_scores(q, k_cache, w, acc)
            M.scatter_reduce_(1, w.q_rows.reshape(1, -1).expand(hkv, -1), s.amax(dim=-1).view(hkv, -1), "amax")
            kept.append(s)
            continue
        qt = q[:, w.rows].view(hkv, -1, T, d)  # (Hkv, nt, T, D)
        if w.k_start is not None:
            kt = shared_kt[w.k_start][:, :w.n_blocks]  # (Hkv, nb, D, B)
        else:
            kt = _run_keys(k_cache, w, acc).transpose(-1, -2).contiguous()
        chunks = _chunks(w, hkv)
        s = None
        for ts, bs in chunks:
            s = _pairs(qt[:, ts], kt[:, bs])  # (Hkv, ct, cb, T, B)
            rows = w.rows.view(-1, T)[ts].reshape(-1)
            M.scatter_reduce_(1, rows.expand(hkv, -1), s.amax(dim=-1).amax(dim=2).reshape(hkv, -1), "amax")
        kept.append((qt, kt, chunks, s if len(chunks) == 1 else None))
    masked = ([plan.partial] if plan.partial is not None else []) + plan.partial_groups
    masked_scores = []
    for p in masked:
        sp = _item_scores(q, k_cache, p, acc)
        M.scatter_reduce_(1, p.q_rows.reshape(1, -1).expand(hkv, -1), sp.amax(dim=-1).view(hkv, -1), "amax")
        masked_scores.append(sp)
    m_safe = _finite(M)

    # Pass 2: exp(s - row max) per block, its sum and its weighted values; blocks added in order.
    O = q.new_zeros((hkv, r + 1, d))
    L = q.new_zeros((hkv, r + 1))

    def add_items(items: Items, s: torch.Tensor) -> None:
        e = s.sub_(m_safe[:, items.q_rows][..., None]).exp_()  # masked keys: exp(-inf) = 0
        rows = items.q_rows.reshape(-1)
        O[:, rows] = O[:, rows] + _item_values(e, v_cache, items, acc).view(hkv, -1, d)
        L[:, rows] = L[:, rows] + e.sum(dim=-1).view(hkv, -1)

    for w, k in zip(plan.work, kept):
        if isinstance(w, Items):
            add_items(w, k)
            continue
        qt, kt, chunks, s_kept = k
        v = _run_keys(v_cache, w, acc)  # (Hkv, nb, B, D)
        tiles = w.rows.view(-1, T)
        o = l = None
        for ts, bs in chunks:
            rows = tiles[ts].reshape(-1)
            ct = rows.numel() // T
            s = s_kept if s_kept is not None else _pairs(qt[:, ts], kt[:, bs])
            e = s.sub_(m_safe[:, rows].view(hkv, ct, 1, T, 1)).exp_()
            l_blk = e.sum(dim=-1)  # (Hkv, ct, cb, T)
            o_blk = _pairs(e, v[:, bs])  # (Hkv, ct, cb, T, D)
            if bs.start == 0:  # a new tile range: its rows' sums so far (zero before their first block)
                o, l = O[:, rows].view(hkv, ct, T, d), L[:, rows].view(hkv, ct, T)
            for j in range(o_blk.shape[2]):
                o, l = o + o_blk[:, :, j], l + l_blk[:, :, j]
            if bs.stop == w.n_blocks:
                O[:, rows] = o.reshape(hkv, -1, d)
                L[:, rows] = l.reshape(hkv, -1)
    for p, sp in zip(masked, masked_scores):  # a row's own block: its last; one item per row at most
        add_items(p, sp)
    l_out = L[:, :r, None]
    # Padded token rows saw nothing (l = 0): give them zeros rather than 0/0.
    return torch.where(l_out > 0, O[:, :r] / l_out, torch.zeros_like(O[:, :r]))


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
