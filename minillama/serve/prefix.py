"""Cached prompt prefixes: a tree of segments in the KV cache, evicted least-recently-used.

A prompt's first whole blocks of KEY_BLOCK tokens (the attention kernel's key blocks) each become one
segment, the child of the block before it; its tokens past them, but the last, a partial block below the
last one; the last token is the request's own segment, where its answer grows. A later prompt that starts
with the same tokens finds the same blocks (keyed by their parent and their tokens) and attaches below
them, so a shared document is computed and stored once; where it parts from a cached partial block, that
block is split there (the tokens before go on being shared, a radix tree's split):

    block 0 (positions 0 .. 63) -> ... -> block 7 (448 .. 511) -> the document's last 38 tokens -> A's question -> A's answer
                                                                                                 \\-> B's question -> B's answer

Each token keeps its position and sees the same tokens at the same positions as in its stand-alone
prompt, so a request's bits do not depend on which blocks it found (attention.py). Blocks whose only
users have finished stay cached; past the memory budget the least recently used leaf blocks are released.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..blocks import KEY_BLOCK
from ..cache import KVCache


@dataclass(eq=False)
class Block:
    segment: int
    parent: "Block | None"
    tokens: tuple[int, ...]
    filled: int = 0  # tokens computed, or scheduled in the pass being built
    refs: int = 0  # live requests whose chain holds this block
    children: dict[tuple[int, ...], "Block"] = field(default_factory=dict)
    used: int = 0  # the tick of its last use: the LRU order

    @property
    def ready(self) -> bool:
        return self.filled == len(self.tokens)

    @property
    def position(self) -> int:
        """The position of its first token: its ancestors' tokens (whole blocks, then any partial ones) before it."""
        at, b = 0, self.parent
        while b is not None:
            at, b = at + len(b.tokens), b.parent
        return at

    @property
    def end(self) -> int:
        """One past the position of its last token."""
        return self.position + len(self.tokens)


class PrefixCache:
    """The block tree over one KVCache. `acquire` finds or creates a prompt's blocks, `release` lets them go."""

    def __init__(self, cache: KVCache, block: int = KEY_BLOCK):
        self.cache = cache
        self.block = block
        self.roots: dict[tuple[int, ...], Block] = {}
        self.blocks: dict[int, Block] = {}  # segment id -> block
        self.tick = 0
        self.hits = 0  # prompt tokens found already computed (for stats)
        self.evicted = 0  # blocks released by `evict`

    def acquire(self, prompt: Sequence[int]) -> list[Block]:
        """The blocks of `prompt`'s whole KEY_BLOCK-token chunks, leaving its last token (whose logits the
        request needs) to the request's own segment, then the cached partial blocks that the prompt continues
        past, the longest at each level. Where it continues past none but begins like an idle one, that block
        is split where they part (`_split`) and the prompt takes its head. New blocks are empty: the engine
        fills them."""
        self.tick += 1
        n = (len(prompt) - 1) // self.block
        chain: list[Block] = []
        level, parent = self.roots, None
        for i in range(n):
            b = self._take(level, parent, tuple(prompt[i * self.block:(i + 1) * self.block]))
            chain.append(b)
            level, parent = b.children, b
        at = n * self.block
        while at < len(prompt) - 1:
            rest = tuple(prompt[at:len(prompt) - 1])  # past the blocks so far, the last token left out
            first = rest[:1]  # a block that the prompt continues past, or parts from partway, begins with it
            alike = [key for key in level if key[:1] == first and len(key) < self.block]
            partial = [key for key in alike if rest[:len(key)] == key]
            if partial:
                key = max(partial, key=len)
            else:
                shared = [(common_length(key, rest), key) for key in alike if level[key].refs == 0 and level[key].ready]
                most, key = max(shared, default=(0, ()))
                if not most:
                    break
                key = self._split(level[key], most).tokens
            b = self._take(level, parent, key)
            chain.append(b)
            level, parent, at = b.children, b, at + len(key)
        return chain

    def acquire_all(self, prompts: Sequence[Sequence[int]]) -> list[list[Block]]:
        """`acquire` for prompts that arrive together; then those that share leading tokens past the same
        last block get a new partial block for the tokens they share (the longest common prefix of those that
        begin alike), computed once for all of them; then each prompt's tokens past its blocks, the last left
        out, become a partial block of its own, which a later prompt that begins alike finds (or splits)."""
        chains = [self.acquire(p) for p in prompts]
        groups: dict[tuple[int | None, int], list[int]] = {}  # (last block, first token past it) -> prompts
        for i, (p, chain) in enumerate(zip(prompts, chains)):
            _, parent, at = self._below(chain)
            if at + 1 < len(p):
                groups.setdefault((parent.segment if parent else None, p[at]), []).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            level, parent, at = self._below(chains[members[0]])
            rests = sorted(tuple(prompts[i][at:len(prompts[i]) - 1]) for i in members)
            first, last = rests[0], rests[-1]  # sorted: what the first and last share, every one shares
            b = self._take(level, parent, first[:common_length(first, last)])
            b.refs += len(members) - 1
            for i in members:
                chains[i].append(b)
        for p, chain in zip(prompts, chains):
            level, parent, at = self._below(chain)
            if at + 1 < len(p):
                chain.append(self._take(level, parent, tuple(p[at:len(p) - 1])))
        return chains

    def _below(self, chain: Sequence[Block]) -> tuple[dict[tuple[int, ...], Block], Block | None, int]:
        """Where a prompt's next block goes under `chain`: (the level it is keyed in, its parent, its first
        position)."""
        if not chain:
            return self.roots, None, 0
        return chain[-1].children, chain[-1], chain[-1].end

    def _take(self, level: dict[tuple[int, ...], Block], parent: Block | None, key: tuple[int, ...]) -> Block:
        """The block `key` below `parent` (found, or new and empty), held once more."""
        b = level.get(key)
        if b is None:
            b = Block(self.cache.new_segment(parent.segment if parent else None), parent, key)
            level[key] = b
            self.blocks[b.segment] = b
        elif b.ready:
            self.hits += len(key)
        b.refs += 1
        b.used = self.tick
        return b

    def _split(self, b: Block, at: int) -> Block:
        """Cut idle block `b` after its first `at` tokens: `b` keeps them and a new child block takes the rest
        and `b`'s children; their keys and values stay where they are (KVCache.split). Returns `b`."""
        level = b.parent.children if b.parent else self.roots
        del level[b.tokens]
        head, rest = b.tokens[:at], b.tokens[at:]
        tail = Block(self.cache.split(b.segment, at), b, rest, filled=len(rest), children=b.children, used=b.used)
        for child in tail.children.values():
            child.parent = tail
        self.blocks[tail.segment] = tail
        b.tokens, b.filled, b.children = head, at, {rest: tail}
        level[head] = b
        return b

    def found(self, prompts: Sequence[Sequence[int]]) -> int:
        """Tokens of these prompts' whole blocks (those `acquire` takes first, from the roots) that the tree holds
        already, each block once: all of a block some running request holds (its computed tokens are in the
        cache, the rest in what that request still adds: `unfilled`), of an idle one the tokens computed. What
        `stored` counts for the prompts but need not be stored again."""
        found: dict[int, int] = {}
        for p in prompts:
            level = self.roots
            for i in range(self.block, len(p), self.block):
                b = level.get(tuple(p[i - self.block:i]))
                if b is None:
                    break
                found[id(b)] = len(b.tokens) if b.refs else b.filled
                level = b.children
        return sum(found.values())

    def release(self, chain: Sequence[Block]) -> None:
        self.tick += 1
        for b in chain:
            b.refs -= 1
            b.used = self.tick

    def evict(self, budget_bytes: int) -> int:
        """Release least-recently-used unused leaf blocks until the cache holds at most `budget_bytes`
        (0: no bound). Returns the number of blocks released."""
        released = 0
        if not budget_bytes or self.cache.used_bytes() <= budget_bytes:
            return 0
        # One scan, then a heap (least recently used first): a parent whose last child goes is a leaf and joins it.
        # A scan per block released (and a count of the cache's slots per check) took 1.5 s for 2,000 blocks.
        idle = [(b.used, b.segment) for b in self.blocks.values() if b.refs == 0 and not b.children]
        heapq.heapify(idle)
        while idle and self.cache.used_bytes() > budget_bytes:
            b = self.blocks[heapq.heappop(idle)[1]]
            self._drop(b)
            released += 1
            if b.parent is not None and b.parent.refs == 0 and not b.parent.children:
                heapq.heappush(idle, (b.parent.used, b.parent.segment))
        self.evicted += released
        return released

    def clear(self) -> None:
        """Release every unused block (leaves first)."""
        while True:
            idle = [b for b in self.blocks.values() if b.refs == 0 and not b.children]
            if not idle:
                return
            for b in idle:
                self._drop(b)

    def _drop(self, b: Block) -> None:
        self.cache.release(b.segment)
        del self.blocks[b.segment]
        (b.parent.children if b.parent else self.roots).pop(b.tokens)

    @property
    def cached_tokens(self) -> int:
        return sum(b.filled for b in self.blocks.values())


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stored(prompts: Sequence[Sequence[int]], block: int = KEY_BLOCK) -> int:
    """Tokens `PrefixCache.acquire_all` and the prompts' own segments store for `prompts` arriving together at an
    empty cache: each whole block once, each group's shared partial block once, each distinct partial block past
    it once, each prompt's last token. (Only what they share as acquire_all shares it counts once: a prompt that
    holds another's partial tail in a whole block, or parts from the group past what all of them share, does not.)"""
    whole: dict[tuple[int, tuple[int, ...]], int] = {}  # (its parent's number, its tokens) -> its number
    groups: dict[tuple[int, int], set[tuple[int, ...]]] = {}  # (the last whole block, the first token past) -> rests
    for p in prompts:
        parent = -1
        for i in range(block, len(p), block):
            parent = whole.setdefault((parent, tuple(p[i - block:i])), len(whole))
        at = (len(p) - 1) // block * block
        if at + 1 < len(p):
            groups.setdefault((parent, p[at]), set()).add(tuple(p[at:len(p) - 1]))
    tokens = len(whole) * block + len(prompts)
    for rests in groups.values():
        shared = common_length(min(rests), max(rests)) if len(rests) > 1 else 0
        tokens += shared + sum(len(r) - shared for r in rests)
    return tokens


def unfilled(chains: Iterable[Sequence[Block]]) -> int:
    """Tokens of these chains' blocks not computed yet, a block held by several chains once."""
    return sum({id(b): len(b.tokens) - b.filled for chain in chains for b in chain if not b.ready}.values())
