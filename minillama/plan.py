"""The plan of one forward pass's blocked attention: which query rows meet which key blocks, in what tiles.

attention.py states the rule and the blocked order a row's keys are added in, blocks.py how keys are cut into blocks and
the two kinds of item (whole, partial); this module lays out the pass so that `attention.blocked_attention` can issue
every (query tile, key block) product in a few fixed-shape batched calls. Shape letters are attention.py's
(N, G, S, R, B, T, I); the plan is built on the host with whole-pass numpy operations and moved to the device once per
tensor, so its cost does not grow with the number of groups (tests/test_signatures.py counts a decode step's launches).

The steps, one function each:

1. `group_tokens`: group the pass's tokens by the key blocks they see, whole blocks by (owner, block) and
   partial blocks by (segment, block);
2. `tile_rows`: lay each group's query rows into tiles of T rows, the last one padded with the spare row;
3. `items_of_every_head`: every tile against its group's key block, once per KV head, padded to whole
   batches with dummy items;
4. `partial_mask`: the mask of the partial blocks (the keys past the row's position, or before its
   window);
5. `row_order`: for a pass whose items all fit at once (every decode step), each query row's terms in the
   order they are added, so that the kernel adds them in a loop fixed by the plan's shape rather than one
   step per distinct block (what a captured step needs: docs/gpu.md).

With `buckets`, every count is rounded up to one of a few sizes (`bucket`): the pass's rows (done by the
caller), each kind's items and the terms per row. Padding adds dummy items and zero terms, which never
change a real row's bits, and a step of one bucket has one shape whatever the pass holds (step.py).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple

import numpy as np
import torch

from .blocks import KEY_BLOCK, AttentionTiles, ItemTiles, visible_blocks
from .batched import batch_items, last_tile, long_tile, proven_rows, proven_run, proven_scan
from .cache import PAD_SLOT, KVCache
from .transfer import to_device

NEVER = np.iinfo(np.int64).max  # the position of a padding key: never visible
Groups = dict[tuple[int, int], list[int]]  # (segment, block) -> the pass's tokens in that group, in order


class Item(NamedTuple):
    """One (query tile, key block) item read back in the pass's own terms, padding left out."""

    block: int  # the key block: logical positions block * B .. block * B + B - 1
    rows: torch.Tensor  # (n, 3) the tile's query rows as (KV head, token, query head within the group)
    slots: torch.Tensor  # (k,) the block's cache slots, in position order
    positions: torch.Tensor  # (k,) their logical positions


@dataclass
class Items:
    """(query tile, key block) items of one kind (whole or partial), padded to whole batches, sorted by block.

    Rows and keys are flat indices, so one gather fetches the tiles of every KV head: query row r of KV
    head h is `h * (R + 1) + r`, and its own spare row r = R pads its tiles (head 0's pads the dummy items);
    key slot s of head h is `h * S + s`. `item(i)` reads item i back as KV heads, tokens and positions.
    """

    rows: torch.Tensor  # (I, T) flat query rows
    keys: torch.Tensor  # (I, B) flat key slots; PAD_SLOT (always zeros) pads a block
    hidden: torch.Tensor | None  # (I, T, B) True where the key is not visible; None: whole blocks
    bounds: list[int]  # items of the k-th distinct block are bounds[k] .. bounds[k + 1]
    blocks: list[int]  # the k-th distinct block
    group_size: int  # G
    row_stride: int  # R + 1: flat query rows per KV head, the spare row included
    key_stride: int  # S: flat key slots per KV head
    # (lo, hi, first): items lo .. hi - 1 meet one key block and go as one run (ItemTiles.runs, `key_runs`);
    # their tiles' rows are the flat rows first, first + 1, ... where first >= 0 (one slice, no gather)
    runs: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def item(self, i: int) -> Item:
        """Item i: its block, the query rows of its tile and the keys of its block (a dummy item has none)."""
        block = self.blocks[bisect.bisect_right(self.bounds, i) - 1]
        keys = self.keys[i].cpu()
        head = int(keys[0]) // self.key_stride  # every row and key of an item is of one KV head
        rows = self.rows[i].cpu() % self.row_stride
        rows = rows[rows != self.row_stride - 1]  # the spare row pads a tile
        slots = keys % self.key_stride
        slots = slots[slots != PAD_SLOT]  # padding only follows a chain's last key
        heads = torch.full_like(rows, head)
        return Item(block, torch.stack([heads, rows // self.group_size, rows % self.group_size], dim=1),
                    slots, block * KEY_BLOCK + torch.arange(len(slots)))


@dataclass
class AttentionPlan:
    """What attention needs for one forward pass, shared by all layers."""

    positions: torch.Tensor  # (N,)
    group_size: int  # G
    whole: Items  # blocks the rows see whole
    partial: Items  # blocks the rows see in part, masked
    # Whole blocks of groups small enough for a proven short tile, in a pass that also has bigger groups (a
    # decode step: a question's own whole blocks, G rows each, beside the document's shared ones), laid out
    # apart in that tile; None where there are none (`_split_small`). Their terms follow the whole items'.
    small: Items | None = None
    # Where every item fits at once: (Hkv * (R + 1), J) each flat query row's terms in the order they are added
    # (whole items' terms first, then partial ones', T per item; index `terms` is a zero term). None: the
    # kernel adds the terms block after block, in chunks (a long prefill).
    order: torch.Tensor | None = None
    # Dense masked path (negative control): visible cache slots of each token.
    visible: torch.Tensor | None = None  # (N, S) bool
    scan: bool = False  # where `order` is: its J additions as one proven scan (batched.proven_scan; a GPU's)
    # The token rows attention runs, R / G: the pass's real tokens, bucketed (step.lay_out). The model's
    # other padding rows skip attention (their output is zero, as a row that sees nothing gets). None: all.
    rows: int | None = None


def bucket(count: int, unit: int = 1, fine: bool = False) -> int:
    """The smallest of the sizes unit * 2^k (`fine`: and 3 * 2^(k - 1)) that holds `count` (at least `unit`)."""
    size = unit << (max(-(-count // unit), 1) - 1).bit_length()  # whole units, to the next power of two
    return size * 3 // 4 if fine and size >= 4 * unit and size * 3 // 4 >= count else size


def plan_attention(cache: KVCache, segments: torch.Tensor, positions: torch.Tensor, group_size: int,
                   n_rows: int, tiles: AttentionTiles, dense: bool = False, window: int | None = None,
                   buckets: bool = False, at_once: bool = False) -> AttentionPlan:
    """Lay out the blocked attention of new tokens already given slots in `cache` (KVCache.append).

    `n_rows` >= N: the rows attention runs (`step.lay_out`: N, a bucket of it, or plain kernels' padded count);
    `window`: the sliding window (config.sliding_window), None for none; `buckets`: round every count up to a
    bucket (`bucket`), so that steps of one bucket have one shape (the padded rows of a dense plan see the
    padding slot only);
    `at_once`: every item held at once (row order) however many, as a compiled step needs (step.py).
    """
    segment_list, position_list = segments.tolist(), positions.tolist()
    whole_groups, partial_groups = group_tokens(cache, segment_list, position_list, window)
    layout = _Pass(cache, position_list, group_size, row_stride=n_rows * group_size + 1, window=window)
    short = not tiles.fused  # proven short batches and item tiles (the fused kernel's items are its own)
    whole_groups, small_groups = _split_small(layout, whole_groups, tiles.whole) if short else (whole_groups, {})
    (whole, whole_rows), (partial, partial_rows) = (
        _lay_out(layout, groups, kind, masked=masked, buckets=buckets, short=short)
        for groups, kind, masked in ((whole_groups, tiles.whole, False), (partial_groups, tiles.partial, True)))
    laid = [(whole, whole_rows, tiles.whole)]
    small = None
    if small_groups:
        small, small_rows = _lay_out(layout, small_groups, tiles.whole, masked=False, buckets=buckets, short=True)
        laid.append((small, small_rows, tiles.whole))
    laid.append((partial, partial_rows, tiles.partial))
    plan = AttentionPlan(positions=positions, group_size=group_size, whole=whole, partial=partial, small=small,
                         rows=n_rows)
    if at_once or all(tiles.held_at_once(items.count, kind) for items, _, kind in laid):
        # A row's terms padded to a bucket, each padding term an addition: finely where a new shape costs a
        # capture, to powers of two where it costs a compile (at_once: a compiled step's layout, step.py).
        order = row_order([rows for _, rows, _ in laid], layout.kv_heads * layout.row_stride, layout.row_stride,
                          (lambda j: bucket(j, fine=not at_once)) if buckets else None)
        plan.order = to_device(torch.from_numpy(order), cache.k.device)
        d, acc = cache.k.shape[-1], torch.promote_types(cache.k.dtype, torch.float32)
        plan.scan = proven_scan((order.shape[0], order.shape[1], d + 1), acc, cache.k.device)
    if dense:
        chain_of = {sid: cache.chain(sid) for sid in dict.fromkeys(segment_list)}
        visible = _dense_visibility(cache, chain_of, segment_list, positions.cpu(), window)
        if n_rows > visible.shape[0]:  # padded rows see the padding slot (zeros), not nothing (NaN)
            visible = torch.cat([visible, torch.zeros(n_rows - visible.shape[0], visible.shape[1], dtype=torch.bool)])
            visible[len(segment_list):, PAD_SLOT] = True
        plan.visible = to_device(visible, cache.k.device)
    return plan


class _Pass:
    """What laying out items needs to know of the pass besides its groups."""

    def __init__(self, cache: KVCache, position_list: list[int], group_size: int, row_stride: int,
                 window: int | None):
        self.cache, self.group_size, self.row_stride, self.window = cache, group_size, row_stride, window
        self.kv_heads, self.key_stride = cache.k.shape[1], cache.k.shape[2]  # Hkv, S
        row_positions = np.full((self.kv_heads, row_stride), -1, dtype=np.int64)  # spare, padded rows: -1
        row_positions[:, :len(position_list) * group_size] = np.repeat(np.asarray(position_list, dtype=np.int64),
                                                                       group_size)
        self.row_positions = row_positions.reshape(-1)  # (Hkv * (R + 1),) the position of each flat query row
        self.chains: dict[int, list[int]] = {}  # each segment's chain slots, fetched once


def _lay_out(layout: _Pass, groups: Groups, kind: ItemTiles, masked: bool, buckets: bool,
             short: bool) -> tuple[Items, np.ndarray]:
    """Steps 2 to 4 for one kind of item, on the host; then one transfer per tensor. Also returns the
    items' flat rows (I, T) on the host, for `row_order`. The items are padded to whole batches, the last
    one short where `short` and a short batch is proven (batched.proven_batches); where `short`, a pass whose
    every group fits a proven smaller tile takes the smallest that holds the largest (batched.proven_rows), one
    of big groups outside `buckets` a proven bigger one (batched.long_tile). In `buckets` the sizes are fixed per
    process (a tile of 4 rows, a short batch of 64 items: buckets of their own); a pass of fewer items than a
    batch takes the smallest proven short batch that holds them, else a whole batch."""
    order = sorted(groups, key=lambda key: key[1])  # by block; stable: a block's groups keep their order
    if short and order:
        most = layout.group_size * max(len(tokens) for tokens in groups.values())  # rows of the largest group
        if most < kind.rows:
            kind = replace(kind, rows=last_tile(most, kind.rows, _proven(proven_rows, kind, layout.cache)),
                           short_rows=())
        elif kind.long_rows and not buckets:  # big groups: a proven bigger tile, where no group makes a run
            kind = _proven(long_tile, kind, layout.cache, [layout.group_size * len(t) for t in groups.values()],
                           layout.kv_heads)
    tiles, tiles_per_group = tile_rows([groups[key] for key in order], layout.group_size, kind.rows,
                                       spare=layout.row_stride - 1)
    block_keys = _block_keys(layout, order)  # (groups, B)
    blocks = np.array([block for _, block in order], dtype=np.int64)  # (groups,)
    real = layout.kv_heads * int(tiles_per_group.sum())
    if buckets and not (short and 0 < real < kind.batch):
        padded = bucket(real, kind.batch)
    else:
        padded = _proven(batch_items, kind, layout.cache, real) if short else -(-real // kind.batch) * kind.batch
    rows, keys, item_blocks, group_of_item = items_of_every_head(tiles, tiles_per_group, block_keys, blocks, layout,
                                                                 padded)
    starts = [0, *(np.flatnonzero(np.diff(item_blocks)) + 1).tolist()]  # each distinct block's first item
    distinct_blocks = item_blocks[starts].tolist() if item_blocks.size else []
    device = layout.cache.k.device
    hidden = None
    if masked:
        hidden = to_device(torch.from_numpy(partial_mask(block_keys, blocks, group_of_item, rows,
                                                         layout.row_positions, layout.window)), device)
    items = Items(to_device(torch.from_numpy(rows), device), to_device(torch.from_numpy(keys), device), hidden,
                  bounds=[*starts, int(item_blocks.size)], blocks=distinct_blocks,
                  group_size=layout.group_size, row_stride=layout.row_stride, key_stride=layout.key_stride)
    if kind.runs and short and not masked and not buckets:  # runs follow the pass's blocks, not its shapes
        items.runs = key_runs(keys, rows, kind, lambda n: _proven(proven_run, kind, layout.cache, n))
    return items, rows


def key_runs(keys: np.ndarray, rows: np.ndarray, kind: ItemTiles, proven) -> list[tuple[int, int, int]]:
    """The runs of a kind's items (I, B keys and T flat rows each) as (lo, hi, first): stretches of at least
    `kind.runs` items that meet one key block, taken only inside whole batches that such stretches fill, so
    that the other items keep their batches (a stretch cut by a batch may leave a shorter run); none unless
    `proven(n)` holds for every run's length n (batched.proven_run). `first` is the run's first flat row
    where its rows follow one another, else -1."""
    if len(keys) < kind.runs:
        return []
    bounds = [0, *(np.flatnonzero((keys[1:] != keys[:-1]).any(axis=1)) + 1).tolist(), len(keys)]
    long = np.zeros(len(keys), dtype=bool)
    for lo, hi in zip(bounds, bounds[1:]):
        long[lo:hi] = hi - lo >= kind.runs
    whole = len(keys) - len(keys) % kind.batch
    covered = np.zeros(len(keys), dtype=bool)  # the items of batches that runs fill
    covered[:whole] = np.repeat(long[:whole].reshape(-1, kind.batch).all(axis=1), kind.batch)
    runs = []
    for lo, hi in zip(bounds, bounds[1:]):
        inside = np.flatnonzero(covered[lo:hi])
        if inside.size:
            first, end = lo + int(inside[0]), lo + int(inside[-1]) + 1
            flat = rows[first:end].reshape(-1)
            runs.append((first, end, int(flat[0]) if (np.diff(flat) == 1).all() else -1))
    return runs if all(proven(hi - lo) for lo, hi, _ in runs) else []


def _split_small(layout: _Pass, groups: Groups, kind: ItemTiles) -> tuple[Groups, Groups]:
    """(big groups, small groups): where some of a pass's whole-block groups fit the largest proven short
    tile and some do not, the small ones apart, to be laid out in the smallest proven tile that holds them
    (a decode step's own whole blocks of one question, 3 rows each, beside the document's, 3 rows per
    question: 4-row items rather than 32). Else every group stays (`_lay_out` then takes one tile for all).

    Kept in order: a row's terms are added big items first, then small ones, and that is its block order.
    A row's later whole block is seen by a subset of the rows that see its earlier ones (the rows under the
    later block's owner, at later positions), so a row's groups shrink along its blocks and every big one
    comes before every small one. Not so with a sliding window (an early block's group can be the smaller):
    no split there."""
    if layout.window is not None or not groups:
        return groups, {}
    proven = _proven(proven_rows, kind, layout.cache)
    if not proven:
        return groups, {}
    fits = max(proven) // layout.group_size  # tokens per group that the largest proven tile holds
    small = {key: tokens for key, tokens in groups.items() if len(tokens) <= fits}
    if not small or len(small) == len(groups):
        return groups, {}
    return {key: tokens for key, tokens in groups.items() if len(tokens) > fits}, small


def _proven(proof, kind: ItemTiles, cache: KVCache, *args):
    """What `proof` (of batched.py) shows for this kind in the attention arithmetic of the cache's model."""
    return proof(kind, cache.k.shape[-1], *args, torch.promote_types(cache.k.dtype, torch.float32), cache.k.device)


# --- 1. group the tokens by the blocks they see ------------------------------------------------------

def group_tokens(cache: KVCache, segment_list: list[int], position_list: list[int],
                 window: int | None) -> tuple[Groups, Groups]:
    """(whole groups, partial groups): the pass's tokens by the key blocks they see whole or in part.

    A query at position p sees whole blocks and part of the blocks holding p and its first visible
    position (`visible_blocks`). Whole block b belongs to the chain segment holding its last position
    bB + B - 1 (its "owner"): the queries of all segments under that owner see the same keys there, so
    they share a group, and tiles. A partial block is its segment's own: the mask follows each row.
    """
    by_segment: dict[int, list[int]] = {}  # the pass's tokens of each segment, in position order
    for token, sid in enumerate(segment_list):
        by_segment.setdefault(sid, []).append(token)
    whole: Groups = {}
    partial: Groups = {}
    for sid, tokens in by_segment.items():
        owners = _block_owners(cache, sid)
        for token in tokens:
            whole_blocks, partial_blocks = visible_blocks(position_list[token], window)
            for owner, first, end in owners:
                for block in range(max(first, whole_blocks.start), min(end, whole_blocks.stop)):
                    whole.setdefault((owner, block), []).append(token)
            for block in partial_blocks:
                partial.setdefault((sid, block), []).append(token)
    return whole, partial


def _block_owners(cache: KVCache, sid: int) -> list[tuple[int, int, int]]:
    """(segment, first block, end block) of each segment of sid's chain, root first: a segment owns the
    blocks whose last position it holds; sid owns every block after its parent's."""
    owners = []
    for segment in cache.chain(sid):
        held = cache.segments[segment]
        if held.start is not None:
            end = held.end // KEY_BLOCK if segment != sid else 1 << 62
            owners.append((segment, held.start // KEY_BLOCK, end))
    return owners


def _block_keys(layout: _Pass, order: list[tuple[int, int]]) -> np.ndarray:
    """(groups, B) the cache slots of each group's key block, padded with PAD_SLOT past its chain's end."""
    keys = []
    for sid, block in order:
        if sid not in layout.chains:
            layout.chains[sid] = layout.cache.chain_slots(sid)
        slots = layout.chains[sid][block * KEY_BLOCK:(block + 1) * KEY_BLOCK]
        keys.append(slots + [PAD_SLOT] * (KEY_BLOCK - len(slots)))
    return np.array(keys, dtype=np.int64).reshape(len(order), KEY_BLOCK)


# --- 2. lay each group's rows into tiles -------------------------------------------------------------

def tile_rows(tokens_per_group: list[list[int]], group_size: int, tile: int,
              spare: int) -> tuple[np.ndarray, np.ndarray]:
    """Each group's query rows (G per token, row n * G + g) in tiles of `tile` rows, groups one after
    another, each group's last tile padded with the `spare` row. Returns (tiles (tiles, T), tiles per group)."""
    rows_per_group = np.fromiter((len(tokens) * group_size for tokens in tokens_per_group), dtype=np.int64,
                                 count=len(tokens_per_group))  # (groups,)
    tiles_per_group = -(-rows_per_group // tile)
    tokens = np.fromiter(itertools.chain.from_iterable(tokens_per_group), dtype=np.int64)
    rows = (tokens[:, None] * group_size + np.arange(group_size)).reshape(-1)  # every group's rows, in order
    group_of_row = np.repeat(np.arange(len(tokens_per_group)), rows_per_group)
    first_tile = np.cumsum(tiles_per_group) - tiles_per_group
    first_row = np.cumsum(rows_per_group) - rows_per_group
    tiles = np.full(int(tiles_per_group.sum()) * tile, spare, dtype=np.int64)
    tiles[first_tile[group_of_row] * tile + np.arange(rows.size) - first_row[group_of_row]] = rows
    return tiles.reshape(-1, tile), tiles_per_group


# --- 3. every tile against its block, for every KV head, in whole batches -----------------------------

def items_of_every_head(tiles: np.ndarray, tiles_per_group: np.ndarray, block_keys: np.ndarray,
                        blocks: np.ndarray, layout: _Pass, count: int) -> tuple[np.ndarray, ...]:
    """(flat rows (I, T), flat keys (I, B), block (I,), group of each real item) of every item: per group,
    its tiles for KV head 0, then for head 1, ...; then dummy items (the spare row against the padding
    slot) up to `count` items (whole batches).

    A worked example: 3 tokens, G = 2 query rows per token (rows 0-5), tiles of T = 4 rows, 2 KV heads, the
    pass padded to 4 tokens (R = 8, so a head's flat rows are h * 9 + r and row 8 is the spare), S = 100
    cache slots per head (flat key h * 100 + s). Group 0: all three tokens see block 0 (slots 10-73);
    group 1: token 2 alone sees block 1 (slots 20-83). `tile_rows` gave tiles [0 1 2 3], [4 5 8 8] for
    group 0 (tiles_per_group 2) and [4 5 8 8] for group 1 (1). With count = 8 (batches of 4):

        item  group  head  rows (T)       keys (B)          block
        0     0      0     0  1  2  3     10 .. 73          0
        1     0      0     4  5  8  8     10 .. 73          0
        2     0      1     9 10 11 12     110 .. 173        0     head 1: rows + 9, keys + 100
        3     0      1     13 14 17 17    110 .. 173        0     (17 is head 1's spare row: 9 + 8)
        4     1      0     4  5  8  8     20 .. 83          1
        5     1      1     13 14 17 17    120 .. 183        1
        6, 7  dummy        8  8  8  8     0 (PAD_SLOT) x B  1     the last block: dummies join it

    tests/test_attention.py reads items back (`Items.item`) and checks every row meets exactly its blocks."""
    items_per_group = layout.kv_heads * tiles_per_group
    group_of_item = np.repeat(np.arange(len(tiles_per_group)), items_per_group)
    in_group = np.arange(group_of_item.size) - (np.cumsum(items_per_group) - items_per_group)[group_of_item]
    head = in_group // tiles_per_group[group_of_item]
    tile = (np.cumsum(tiles_per_group) - tiles_per_group)[group_of_item] + in_group % tiles_per_group[group_of_item]
    dummies = count - group_of_item.size
    spare = layout.row_stride - 1
    rows = np.concatenate([tiles[tile] + (head * layout.row_stride)[:, None],
                           np.full((dummies, tiles.shape[1]), spare, dtype=np.int64)])  # (I, T)
    keys = np.concatenate([block_keys[group_of_item] + (head * layout.key_stride)[:, None],
                           np.full((dummies, KEY_BLOCK), PAD_SLOT, dtype=np.int64)])  # (I, B)
    last_block = blocks[-1] if blocks.size else 0  # dummies join the last block
    item_blocks = np.concatenate([blocks[group_of_item], np.full(dummies, last_block, dtype=np.int64)])
    return rows, keys, item_blocks, group_of_item


# --- 4. the mask of a partial block ------------------------------------------------------------------

def partial_mask(block_keys: np.ndarray, blocks: np.ndarray, group_of_item: np.ndarray, rows: np.ndarray,
                 row_positions: np.ndarray, window: int | None) -> np.ndarray:
    """(I, T, B) True where a key is hidden from a row: past its position, before its window, or padding.

    row_positions: the position of every flat query row (-1 for the spare and padded rows: they see
    nothing); the items past those of group_of_item are dummies, all hidden.
    """
    key_positions = np.where(block_keys == PAD_SLOT, NEVER, blocks[:, None] * KEY_BLOCK + np.arange(KEY_BLOCK))
    dummies = rows.shape[0] - group_of_item.size
    item_keys = np.concatenate([key_positions[group_of_item],
                                np.full((dummies, KEY_BLOCK), NEVER, dtype=np.int64)])[:, None, :]  # (I, 1, B)
    item_rows = row_positions[rows][:, :, None]  # (I, T, 1)
    hidden = item_keys > item_rows  # (I, T, B)
    if window is not None:  # cut on the left too (padding keys, at NEVER, stay hidden)
        hidden |= item_keys <= item_rows - window
    return hidden


# --- 5. each row's terms in the order they are added ----------------------------------------------------

def row_order(rows_of_kind: list[np.ndarray], flat_rows: int, row_stride: int,
              buckets: Callable[[int], int] | None) -> np.ndarray:
    """(flat_rows, J) the terms of each flat query row in the order the kernel adds them, then the zero term.

    rows_of_kind: each kind's items' flat rows (I, T), whole items first; the pass's terms are numbered
    like them (term i * T + t is row rows[i, t] of item i), kind after kind, and the number after the last
    one is a zero term. Items are sorted by block, so a row's terms come in block order, whole blocks before
    partial ones: exactly the order in which the chunked kernel adds them. The padding at the end of a row
    adds zeros, which changes nothing (a sum that starts at +0 is never -0, so s + 0 = s); J is the most
    terms of any row, or `buckets` of it. Spare rows (which pad tiles) get no terms.
    """
    flat = np.concatenate([r.reshape(-1) for r in rows_of_kind])  # (terms,) the row each term belongs to
    terms = np.flatnonzero(flat % row_stride != row_stride - 1)  # the real rows' terms, in order
    by_row = np.argsort(flat[terms], kind="stable")  # grouped by row, each row's terms keeping their order
    rows, terms = flat[terms][by_row], terms[by_row]
    counts = np.bincount(rows, minlength=flat_rows)
    rank = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]  # the place of each term in its row
    most = int(counts.max()) if counts.size else 0
    table = np.full((flat_rows, buckets(most) if buckets else max(most, 1)), flat.size, dtype=np.int64)
    table[rows, rank] = terms
    return table


def _dense_visibility(cache: KVCache, chains: dict[int, list[int]], segment_list: list[int],
                      positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(N, S) bool: the segment rule (and the window) written out over every cache slot."""
    slot_segment = torch.full((cache.k.shape[2],), -1, dtype=torch.long)  # (S,)
    slot_position = torch.full((cache.k.shape[2],), -1, dtype=torch.long)  # (S,)
    for sid, held in cache.segments.items():
        if held.slots:
            index = torch.tensor(held.slots, dtype=torch.long)
            slot_segment[index] = sid
            slot_position[index] = torch.arange(held.start, held.end)
    in_chain = {sid: torch.isin(slot_segment, torch.tensor(chain)) for sid, chain in chains.items()}
    rows = torch.stack([in_chain[sid] for sid in segment_list])  # (N, S)
    seen = rows & (slot_position[None, :] <= positions[:, None]) & (slot_segment[None, :] >= 0)
    return seen if window is None else seen & (slot_position[None, :] > positions[:, None] - window)
