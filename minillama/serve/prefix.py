"""Cached prompt prefixes: a tree of KEY_BLOCK-token segments in the KV cache, evicted least-recently-used.

A prompt's first whole blocks of KEY_BLOCK tokens (the attention kernel's key blocks) each become one
segment, the child of the block before it; the rest of the prompt is the request's own segment under its
last block. A later prompt that starts with the same tokens finds the same blocks (keyed by their parent
and their tokens) and attaches below them, so a shared document is computed and stored once:

    block 0 (positions 0 .. 63) -> block 1 (64 .. 127) -> ... -> request A's tail and answer
                                                          \\-> request B's tail and answer

Each token keeps its position and sees the same tokens at the same positions as in its stand-alone
prompt, so a request's bits do not depend on which blocks it found (attention.py). Blocks whose only
users have finished stay cached; past the memory budget the least recently used leaf blocks are released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

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
        """The position of its first token (its ancestors are whole blocks; it may be a partial one)."""
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
        request needs) to the request's own segment, then the longest cached partial block that the prompt
        continues past, if any. New blocks are empty: the engine fills them."""
        self.tick += 1
        n = (len(prompt) - 1) // self.block
        chain: list[Block] = []
        level, parent = self.roots, None
        for i in range(n):
            b = self._take(level, parent, tuple(prompt[i * self.block:(i + 1) * self.block]))
            chain.append(b)
            level, parent = b.children, b
        rest = tuple(prompt[n * self.block:len(prompt) - 1])  # past the whole blocks, the last token left out
        partial = [key for key in level if len(key) < self.block and rest[:len(key)] == key]
        if partial:
            chain.append(self._take(level, parent, max(partial, key=len)))
        return chain

    def acquire_all(self, prompts: Sequence[Sequence[int]]) -> list[list[Block]]:
        """`acquire` for prompts that arrive together; then those that found no partial block and share
        leading tokens past the same last whole block get a new partial block for the tokens they share
        (the longest common prefix of those that begin alike), computed once for all of them."""
        chains = [self.acquire(p) for p in prompts]
        groups: dict[tuple[int | None, int], list[int]] = {}  # (last whole block, first token past it) -> prompts
        for i, (p, chain) in enumerate(zip(prompts, chains)):
            at = chain[-1].end if chain else 0
            if at + 1 < len(p) and (not chain or len(chain[-1].tokens) == self.block):  # no partial block found
                groups.setdefault((chain[-1].segment if chain else None, p[at]), []).append(i)
        for members in groups.values():
            if len(members) < 2:
                continue
            chain = chains[members[0]]
            at = chain[-1].end if chain else 0
            rests = sorted(tuple(prompts[i][at:len(prompts[i]) - 1]) for i in members)
            first, last = rests[0], rests[-1]  # sorted: what the first and last share, every one shares
            shared = next((k for k, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last)))
            level = chain[-1].children if chain else self.roots
            b = self._take(level, chain[-1] if chain else None, first[:shared])
            b.refs += len(members) - 1
            for i in members:
                chains[i].append(b)
        return chains

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

    def release(self, chain: Sequence[Block]) -> None:
        self.tick += 1
        for b in chain:
            b.refs -= 1
            b.used = self.tick

    def evict(self, budget_bytes: int) -> int:
        """Release least-recently-used unused leaf blocks until the cache holds at most `budget_bytes`
        (0: no bound). Returns the number of blocks released."""
        released = 0
        while budget_bytes and self.cache.used_bytes() > budget_bytes:
            idle = [b for b in self.blocks.values() if b.refs == 0 and not b.children]
            if not idle:
                break
            self._drop(min(idle, key=lambda b: b.used))
            released += 1
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
