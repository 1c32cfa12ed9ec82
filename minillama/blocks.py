"""Key blocks: how a query row's keys are cut into blocks, and the sizes attention's items are issued in.

The planner (plan.py) and the kernel (attention.py) both read this module and it reads neither, so the
arrow between them runs one way (attention uses the plan's types, the plan never imports attention).

A query row's keys are taken in logical order (its chain, by position) and cut into blocks of `KEY_BLOCK`
keys at positions 0, B, 2B, ... Every (row, block) pair is one row of a fixed-shape product, an *item*
(a tile of T query rows against the B keys of one block), of one of two kinds:

    whole     the row sees every key of the block;
    partial   the row sees part of it (masked): the block holding the row's own position (cut on the
              right) and, with a sliding window, the block holding its first visible position (cut on the
              left; one block may be cut on both sides).

Which kind a pair is depends on the row's position only (`visible_blocks`). Each kind has its own sizes
(`ItemTiles`: rows per tile, items per batched call, items held at once), fixed per device
(`CPU_ATTENTION`, `CUDA_ATTENTION`) and never by the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEY_BLOCK = 64  # B: keys per block, aligned to logical positions


def first_visible(position: int, window: int | None) -> int:
    """The first position of its chain a query at `position` sees (0 without a sliding window)."""
    return 0 if window is None else max(0, position - window + 1)


def visible_blocks(position: int, window: int | None) -> tuple[range, list[int]]:
    """The blocks a query at `position` visits: (whole blocks, partial blocks), each in block order."""
    first = first_visible(position, window)
    whole = range(-(-first // KEY_BLOCK), (position + 1) // KEY_BLOCK)
    return whole, [block for block in sorted({first // KEY_BLOCK, position // KEY_BLOCK}) if block not in whole]


@dataclass(frozen=True)
class ItemTiles:
    """The fixed sizes of one kind of (query tile, key block) item."""

    rows: int  # T: query rows per tile
    batch: int  # items per batched call (`batched.batched_products`)
    # Most items whose scores are computed at once (a multiple of the batch): a longer pass goes chunk by
    # chunk, twice (once for the row maxima, once for the values), its scores held up to
    # `AttentionTiles.hold` items and computed again past that. On a CPU, small chunks win: a chunk's
    # gathered tiles, keys and scores stay in cache, where fresh multi-megabyte temporaries cost page faults
    # and memory traffic (docs/bench/README.md has the measurements).
    chunk: int
    # Smaller item counts that may stand in for a pass's last batch of this kind, so that a pass of few items
    # (one sequence decoding) does not pay for a whole batch: used only where the process has shown that a
    # call of that many items gives every item the bits a whole batch's call gives it
    # (`batched.proven_batches`: on a CPU in float32, on a GPU). The answers are the whole batches' either way.
    short: tuple[int, ...] = ()
    # Smaller tiles that may stand in for `rows` in a pass whose every group of rows fits one (a decode step
    # brings each block G rows per question: 3 of 32), used only where the process has shown that a call of
    # items of that many rows gives every row the bits of a whole tile (`batched.proven_rows`). A row's
    # products and sums are its own, so the tile it shares changes nothing where the kernel keeps its order.
    short_rows: tuple[int, ...] = ()
    # The fewest items meeting one key block that a long pass may take as one run: the tiles' rows stacked
    # into one oneDNN product against the block (and its values), where the process has shown that this gives
    # every item the bits of its batch's `bmm` calls (`batched.proven_run`). 0: never. A run's keys and values
    # are read once, not gathered per item, and a product of many rows runs nearer the GEMM's pace.
    runs: int = 0
    # Bigger tiles, multiples of `rows`, that a pass whose groups are big but too few rows for a run may take
    # (a decode step of 64 questions brings 192 rows to each document block: 3 tiles of 64, not 6 of 32, so
    # each block's keys and values are gathered half as often), used only where they pad the groups at most
    # 1/8 past tiles of `rows` and the process has shown that every row of such a tile gets the bits of its
    # own `rows`-row tile (`batched.long_tile`). The answers are the `rows`-row tiles' either way.
    long_rows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.chunk % self.batch:
            raise ValueError("chunks must hold whole batches")


@dataclass(frozen=True)
class AttentionTiles:
    """The sizes every attention product is issued with. Changing them changes the bits (another kernel),
    never the parity; both runs of a comparison must use the same ones."""

    whole: ItemTiles = field(default_factory=lambda: ItemTiles(rows=64, batch=32, chunk=128))
    partial: ItemTiles = field(default_factory=lambda: ItemTiles(rows=8, batch=256, chunk=512))
    # A kind with at most this many items in a pass keeps its scores (one chunk, nothing recomputed),
    # whatever the chunk size: a decode step over a long document (576 whole items at 4,096 tokens) gains
    # from one chunk, while a prefill's tens of thousands of items still go in small chunks.
    keep: int = 0
    # Most items of a kind whose scores a pass past one chunk holds, chunk by chunk, from its first pass (the
    # row maxima) to its second (the values), rather than compute them again (its first chunk always): the
    # same products, the same bits, with the memory bounded (a CPU's 16,384 whole items: 128 MB of scores).
    hold: int = 0
    # How a block's terms are added to its rows (attention._add_rows): one `index_add_` (one launch), or a
    # gather, an add and an `index_put_` (a CPU's choice: its index_add_ is far slower with few threads).
    # The same IEEE additions either way: the bits do not depend on it.
    index_add: bool = False
    # How an item's softmax is taken: in separate passes over its scores (`bmm`, mask, exp, sums, `bmm`), or
    # by torch's fused CPU attention kernel, which returns each row's softmax over the block and the block's
    # log-sum-exp (attention.fused_items): another arithmetic, so other bits, each a function of its item.
    fused: bool = False
    # A compiled step holds every item of its pass at once (step.lay_out's `at_once`): a pass whose estimate of
    # that memory (`Llama.at_once_bytes`) passes this many bytes goes as passes of half its tokens, as many
    # times as it takes (the same bits: a row's result is its own). 0: no bound.
    at_once: int = 0

    def held_at_once(self, count: int, kind: ItemTiles) -> bool:
        """Whether the kernel holds every one of `count` items of a kind at once: one chunk, or at most `keep`."""
        return count <= kind.chunk or count <= self.keep


# A CPU: whole-block tiles of 32 rows, which multiply about as fast per row as 64 and waste half as much on
# the blocks a single question owns (a decode step brings G rows to each: 3 of 32, not 3 of 64), so decoding
# long answers costs less; the masked own-block items in tiles of 16 rows (a question's own block in half as
# many items as with 8: half the keys and values gathered, 1.05x a 256-question or the paper's prefill, the
# same bits) and bmm calls of 64 rather than 256 (their scores and keys stay in cache through each call).
# Chunks hold as many rows as with 64-row tiles; `keep` half as many: a prefill pass of 512 tokens (1,152
# whole items at the default model's shape) held at once gathers ~40 MB of keys and values, where chunks of
# 256 items, scores computed twice, stay in cache (1.2x faster at 256 questions, and a decode step over a
# 4,000-token document 1.7x).
# Past `keep`, the chunks' scores are held up to `hold` items rather than computed twice: gathers and products
# stay chunk-sized, and a prefill of 256 questions runs 1.08x faster than with every chunk computed twice.
# Where 16 or more tiles in a row meet one key block (a document's block in a big pass: 48 tiles a KV head in a
# 512-token pass), they go as one run: one oneDNN product of their rows against the block, keys and values read
# once, where proven to give each item its batch's bits (a 256-question prefill 1.11x). Not in a decode step: 64
# questions bring 6 tiles to each block, and runs of 4 there (one product pair per block and head) gave the same
# tokens but took 1.4x the step's time at a 512-token document (more, smaller calls than the batched bmm). Tiles
# of 64 rows there instead (`long_rows`, where proven: 3 a block, keys and values gathered half as often) took
# 0.89x the step's time at 1,024- and 2,048-token documents (medians of 4 alternating runs), 0.77x at 4,096, every
# logit the same; tiles of 128 (192 rows padded to 256) took 1.09x at 512. Tiles of 192 (one a block) took 0.94x
# of 64's time at 2,048 tokens, 0.88x at 4,096; 1.07-1.09x at 512 and 1,024, where their few items leave a call a
# third empty: a long tile is taken only where its items, padded to their calls, hold at most 1/8 more rows. Tiles
# of 96 (32 questions: one a block) took 0.92x of 32's time at 2,048 tokens, 0.80x at 4,096. A pass whose tiles of
# 32 take one call keeps them, and proves no long tile (those proofs took ~0.4 s of a process's first pass).
# A pass whose groups are all small (a decode step of a few questions) takes 4- to 16-row tiles where proven:
# one sequence's decode step in 4-row tiles is 1.1x faster than in 32 and 8. docs/bench/README.md has the
# measurements.
CPU_ATTENTION = AttentionTiles(whole=ItemTiles(rows=32, batch=64, chunk=256, short=(8, 16, 32), short_rows=(4, 8, 16),
                                                runs=16, long_rows=(64, 96, 192)),
                               partial=ItemTiles(rows=16, batch=64, chunk=512, short=(8, 16, 32), short_rows=(4, 8)),
                               keep=640, hold=16384, at_once=256 << 20)
# A GPU (an H200, Llama-3-8B's shape, the paper's configuration): whole-block tiles of 128 rows in batches of
# 128, masked own-block tiles of 16 rows in batches of 512. Each alone ran 0.86-0.96x (whole) and 0.82-0.92x
# (masked) the time of 64-row / 8-row tiles in batches of 256 / 1,024, in three runs on two days; a decode step
# of 64 questions then fills its batch of 512 masked items rather than padding 512 to 1,024. Batches and chunks
# stay big enough that a pass issues few launches (tests/test_signatures.py counts them).
# Where the GPU proves them (batched.py, in the host half, once per process and shape), a pass whose groups are
# all small takes short item tiles, and a pass of fewer items than a batch a short batch, as a CPU does, in
# buckets too: a decode step of 64 questions at Llama-3-8B's shape brings 4 rows (the G query heads of one
# token) to each question's own masked block, a 16-row tile; one question alone brings 4 rows to each of the
# document's blocks, a 128-row tile, in 64 of a batch's 128 items. Unproven, a pass pays for the whole tile.
CUDA_ATTENTION = AttentionTiles(whole=ItemTiles(rows=128, batch=128, chunk=8192, short=(16, 32, 64),
                                                short_rows=(4, 8, 16, 32, 64)),
                                partial=ItemTiles(rows=16, batch=512, chunk=16384, short=(64, 128, 256),
                                                  short_rows=(4, 8)),
                                index_add=True, at_once=1 << 30)
