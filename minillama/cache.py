"""The KV cache: every token's keys and values stored once, in slots, with the segment tree beside them.

A *segment* is a run of tokens with consecutive positions: a document, a question, a generated answer's
stream, a system prompt. Each segment has at most one parent; its first position is its parent's length
(0 for a root), exactly where it would sit in its own stand-alone prompt:

    segment 0  document   positions 0 .. 99       slots: wherever they were written
    segment 1  question A positions 100 .. 111    parent 0
    segment 2  question B positions 100 .. 108    parent 0

A token sees its ancestors' tokens and the earlier tokens of its own segment (attention.py writes the rule
down). The document's keys and values live in the cache once, however many questions hang off it; a
finished question is `release`d and its slots are reused.

Storage is one preallocated cache written by index, with one slot axis for all sequences:
`k[layer]` is (Hkv, S, D). Two slots are never handed out: slot 0 stays zero (attention reads it as
padding), and slot 1 takes the writes of the padding tokens that round a pass up to its step's shape
(step.py), so a step writes every row without a branch on which rows are real, and no token ever reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import LlamaConfig
from .options import BadType, is_int

PAD_SLOT = 0
SPILL_SLOT = 1  # written by padding tokens, read by nobody


@dataclass
class Segment:
    parent: int | None
    start: int | None = None  # first position; fixed when the first token arrives (= parent's length)
    slots: list[int] = field(default_factory=list)  # slot of each token, in position order
    children: int = 0  # live child segments that already hold tokens

    @property
    def end(self) -> int:
        """One past the last position."""
        return (self.start or 0) + len(self.slots)


class KVCache:
    def __init__(self, config: LlamaConfig, capacity: int = 256, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, kv_heads: int | None = None,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None):
        """kv_heads: the KV heads this process holds (a tensor-parallel rank holds some; default all).
        storage: keys and values (L, Hkv, S, D) to hold (a finished cache's, `Steps.spare`): zeroed here, so
        the cache starts as a fresh one does, with S >= capacity slots."""
        self.config = config
        hkv = config.num_key_value_heads if kv_heads is None else kv_heads
        shape = self.shape(config, capacity, hkv)
        # Ordinary tensors, even where a forward pass (inference mode) makes or grows the cache: it outlives the
        # pass, and its storage is written outside one (a spare is zeroed here for the next cache: step.py).
        with torch.inference_mode(False):
            if storage is None:
                self.k = torch.zeros(shape, device=device, dtype=dtype)  # (L, Hkv, S, D)
                self.v = torch.zeros(shape, device=device, dtype=dtype)
            else:
                self.k, self.v = (t.zero_() for t in storage)
            if not self.holds(self.k, shape):
                raise ValueError(f"storage of shape {tuple(self.k.shape)} cannot hold a cache of {shape}")
            shape = tuple(self.k.shape)
        self._free: list[int] = list(range(shape[2] - 1, SPILL_SLOT, -1))  # a stack; slots 0 and 1 held back
        self.segments: dict[int, Segment] = {}
        self._next_id = 0

    @staticmethod
    def shape(config: LlamaConfig, capacity: int, kv_heads: int) -> tuple[int, int, int, int]:
        """(L, Hkv, S, D) of a cache of `capacity` slots (at least the two held back). A capacity that is not an
        integer >= 0 is refused here, before any storage is made (BadType, ValueError)."""
        if not is_int(capacity):
            raise BadType(f"capacity must be an integer >= 0 (cache slots), got {capacity!r}")
        if capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0 (cache slots), got {capacity!r}")
        return config.num_hidden_layers, kv_heads, max(int(capacity), SPILL_SLOT + 2), config.head_dim

    @staticmethod
    def holds(storage: torch.Tensor, shape: tuple[int, int, int, int]) -> bool:
        """Whether keys or values `storage` (L, Hkv, S', D) can hold a cache of `shape`: the same layers, heads
        and head size, and S' >= S slots."""
        return storage.shape[:2] + storage.shape[3:] == shape[:2] + shape[3:] and storage.shape[2] >= shape[2]

    # --- the segment tree -------------------------------------------------------------------------
    def new_segment(self, parent: int | None = None) -> int:
        """A new empty segment, a root or a child of `parent` (a segment id); returns its id."""
        if parent is not None and not is_int(parent):
            raise BadType(f"parent must be a segment id (an integer) or None, got {parent!r}")
        if parent is not None and parent not in self.segments:
            raise KeyError(f"parent segment {parent} does not exist")
        sid = self._next_id
        self._next_id += 1
        self.segments[sid] = Segment(None if parent is None else int(parent))
        return sid

    def chain(self, sid: int) -> list[int]:
        """Segment ids from the root down to `sid`."""
        out = []
        while sid is not None:
            out.append(sid)
            sid = self.segments[sid].parent
        return out[::-1]

    def length(self, sid: int) -> int:
        """Position the next token of `sid` takes."""
        seg = self.segments[sid]
        if seg.start is None:  # no tokens yet: it will start where its parent ends
            return self.length(seg.parent) if seg.parent is not None else 0
        return seg.end

    def release(self, sid: int) -> None:
        """Drop a segment (a finished question): its slots go back to the pool. A segment whose child segments
        hold tokens stays (ValueError): they go first."""
        seg = self.segments[sid]
        if seg.children:
            raise ValueError(f"segment {sid} still has {seg.children} live children")
        self._free.extend(reversed(seg.slots))
        if seg.parent is not None and seg.start is not None:
            self.segments[seg.parent].children -= 1
        del self.segments[sid]

    def split(self, sid: int, at: int) -> int:
        """Cut segment `sid` after its first `at` tokens: a new child segment takes the rest of its tokens and
        its children. Each token keeps its slot, position and keys, and every other segment's chain the same
        tokens in the same order, so nothing anyone computes changes. Returns the new segment's id."""
        seg = self.segments[sid]
        if not 0 < at < len(seg.slots):
            raise ValueError(f"segment {sid} holds {len(seg.slots)} tokens: cannot split it after {at}")
        new = self.new_segment(sid)
        tail = self.segments[new]
        for other in self.segments.values():  # the children start where the tail ends
            if other.parent == sid and other is not tail:
                other.parent = new
        tail.start, tail.slots, tail.children = seg.start + at, seg.slots[at:], seg.children
        del seg.slots[at:]
        seg.children = 1
        return new

    # --- slots --------------------------------------------------------------------------------------
    @property
    def used_slots(self) -> int:
        """Slots that live tokens hold: all but the free ones and the two held back (no scan of the segments)."""
        return self.k.shape[2] - (SPILL_SLOT + 1) - len(self._free)

    def used_bytes(self) -> int:
        """Bytes of keys and values held for live tokens (each stored once)."""
        return self.used_slots * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's keys and values here (this process's KV heads: a rank holds its own)."""
        return self.config.kv_bytes_per_token(self.k.element_size(), kv_heads=self.k.shape[1])

    def reserve(self, slots: int) -> None:
        """Make room for `slots` more tokens at once: one reallocation sized to the need, where appending
        them would double the cache (zero-filling and copying it) several times over."""
        if slots > len(self._free):
            self._grow(slots - len(self._free), double=False)

    def _grow(self, needed: int, double: bool = True) -> None:
        old = self.k.shape[2]
        new = max(2 * old if double else old, old + needed)
        for name in ("k", "v"):
            t = getattr(self, name)
            with torch.inference_mode(False):  # an ordinary tensor, as in __init__
                bigger = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                bigger[:, :, :old] = t
            setattr(self, name, bigger)
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def append(self, segments: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Give each new token a slot. Returns slots (N,), on the host (step.lay_out moves them
        to the device with the step's other inputs).

        Per segment, the new tokens' positions must continue that segment exactly (in call order), and a
        segment whose children already hold tokens cannot grow: its children's positions would overlap.
        The whole call is checked before anything changes: a bad token leaves the cache as it was.
        """
        seg_list = segments.tolist()
        pos_list = positions.tolist()
        # Dry run on the touched segments' (start, length) and live-children counts.
        start: dict[int, int | None] = {}
        length: dict[int, int] = {}
        kids: dict[int, int] = {}
        end = lambda sid: self._end(sid, start, length, kids)  # noqa: E731

        for i, (sid, pos) in enumerate(zip(seg_list, pos_list)):
            if sid not in self.segments:
                raise KeyError(f"token {i}: segment {sid} does not exist")
            expected = end(sid)
            if kids[sid]:
                raise ValueError(f"token {i}: segment {sid} cannot grow after its children got tokens")
            if pos != expected:
                raise ValueError(f"token {i}: segment {sid} expects position {expected}, got {pos}")
            if start[sid] is None:
                start[sid] = expected
                parent = self.segments[sid].parent
                if parent is not None:
                    end(parent)
                    kids[parent] += 1
            length[sid] += 1

        if len(self._free) < len(seg_list):
            self._grow(len(seg_list) - len(self._free))
        slots = [0] * len(seg_list)
        for i, sid in enumerate(seg_list):
            seg = self.segments[sid]
            if seg.start is None:
                seg.start = start[sid]
                if seg.parent is not None:
                    self.segments[seg.parent].children += 1
            slot = self._free.pop()
            seg.slots.append(slot)
            slots[i] = slot
        return torch.tensor(slots, dtype=torch.long)

    def _end(self, sid: int, start: dict[int, int | None], length: dict[int, int], kids: dict[int, int]) -> int:
        """`append`'s dry run: the next position of sid, the call's tokens so far included. (A method, not a
        recursive closure: that would be a reference cycle keeping the cache alive until a garbage collection,
        and a finished cache's storage is what the next one reuses, step.py.)"""
        while True:
            if sid not in start:
                seg = self.segments[sid]
                start[sid], length[sid], kids[sid] = seg.start, len(seg.slots), seg.children
            if start[sid] is not None:
                return start[sid] + length[sid]
            parent = self.segments[sid].parent
            if parent is None:
                return 0
            sid = parent

    def chain_slots(self, sid: int) -> list[int]:
        """Slots of every token `sid` can see when at its last position, indexed by position."""
        out: list[int] = []
        for c in self.chain(sid):
            out.extend(self.segments[c].slots)
        return out


def write_layer(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """One layer's cache (Hkv, S, D) takes k, v: (N, Hkv, D) of the tokens that were given `slots` (SPILL_SLOT
    for padding tokens)."""
    k_cache[:, slots] = k.transpose(0, 1).to(k_cache.dtype)
    v_cache[:, slots] = v.transpose(0, 1).to(v_cache.dtype)
