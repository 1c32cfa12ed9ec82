"""A forward pass as a step of fixed shapes: the host lays it out, the device runs it without looking back.

`Llama.forward` is two halves. The host half (`lay_out`) checks the pass, gives its tokens cache slots and
plans its attention (plan.py), and writes everything the device needs into a `Step`: a few integer tensors
whose shapes are the step's *bucket*. The device half (`Llama.run_step`) is a pure function of the step's
tensors, the weights and the cache: it reads no value back to the host (no `.item()`, `.tolist()`, `nonzero`,
no shape or Python branch that follows a tensor's values; tests/test_step.py audits it), so its launches are
fixed by the bucket alone. That is what lets a GPU capture a step once and replay it (`CapturedSteps`).

Buckets. Without them (a CPU's default) a step is padded only as the kernels need: rows to whole tiles,
items to whole batches. With them (a GPU with captured steps) every count is rounded up to one of a few sizes
(`plan.bucket`): the rows, each kind of attention item, the terms per row, the logits rows. Padding never
changes a real row's bits (padding rows are rows of their own; dummy items meet only the spare row; extra
terms are zeros), so a question's bits do not depend on its step's bucket: test_step.py checks that too.

Captured steps (CUDA). The first step of a bucket runs as it is (it warms the libraries up); the second is
captured as a CUDA graph into static input buffers and replayed; every later one copies its inputs into those
buffers and replays. A graph reads the cache's memory where it was when captured, so the graphs belong to one
cache's storage and are dropped when it grows. When a cache is done with (a generate call returns), its
storage and graphs are kept as the model's spare: the next cache the model makes of no more slots is made on
that storage, zeroed (a fresh cache's state), and replays those graphs rather than capture them again.

Compiled steps (`Steps.compiled`, off by default). Each layer runs through torch.compile (`compile_block`);
every pass is then laid out in buckets with its attention items held at once, so that no pass runs eagerly
(compiled bits are not eager bits, and a cache must not mix them). Captured or not, as above.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .cache import SPILL_SLOT, KVCache
from .config import LlamaConfig
from .errors import BadInput
from .invariant import Kernels
from .plan import AttentionPlan, Items, bucket, plan_attention
from .transfer import to_device


class Pack:
    """A pass's new tokens as `Llama.forward` takes them: pieces (segment, first position, token ids) packed
    one after another into tokens, positions and segments (generate's passes and the server's alike)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.segments: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def put(self, segment: int, start: int, ids: Sequence[int]) -> int:
        """Append a piece at positions start, start + 1, ...; returns the row of its last token."""
        self.tokens.extend(ids)
        self.segments.extend([segment] * len(ids))
        self.positions.extend(range(start, start + len(ids)))
        return len(self.tokens) - 1

    def tensors(self, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, positions, segments) of rows lo .. hi - 1, each (N,)."""
        return (torch.tensor(self.tokens[lo:hi]), torch.tensor(self.positions[lo:hi]),
                torch.tensor(self.segments[lo:hi]))


@dataclass
class Step:
    """Everything the device half of a pass reads besides the weights and the cache, in bucket shapes."""

    tokens: torch.Tensor  # (rows,) token ids, padding rows 0
    positions: torch.Tensor  # (rows,) positions, padding rows 0
    slots: torch.Tensor  # (rows,) the cache slot each row's keys and values go to (SPILL_SLOT for padding)
    logits_rows: torch.Tensor  # (L,) the rows whose logits are wanted (padded with row 0)
    plan: AttentionPlan  # its tensors are the step's too (`tensors`)
    wanted: int  # the logits rows that are real: the first `wanted` of the L

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the device half reads, in a fixed order (the inputs a captured step copies in)."""
        plan = self.plan
        out = [self.tokens, self.positions, self.slots, self.logits_rows]
        for items in (plan.whole, plan.small, plan.partial):
            if items is not None:
                out += [items.rows, items.keys] + ([] if items.hidden is None else [items.hidden])
        return out + [t for t in (plan.order, plan.visible) if t is not None]

    @property
    def capturable(self) -> bool:
        """Whether the device half's launches follow from the tensors' shapes alone. Not so for a pass whose
        attention goes block after block in chunks (`plan.order` None, a long prefill): its loops follow the
        plan's distinct blocks, which two passes of one shape need not share. It runs eagerly."""
        return self.plan.order is not None or self.plan.visible is not None

    def key(self) -> tuple:
        """The bucket: every input's shape and dtype. Steps with one key issue the same launches."""
        return (self.plan.rows, *((tuple(t.shape), t.dtype) for t in self.tensors()))

    def with_tensors(self, tensors: list[torch.Tensor]) -> "Step":
        """This step over other tensors of the same shapes (a captured step's static buffers)."""
        it = iter(tensors)
        plan = self.plan
        tokens, positions, slots, logits_rows = next(it), next(it), next(it), next(it)

        def items_of(items: Items) -> Items:
            rows, keys = next(it), next(it)
            return replace(items, rows=rows, keys=keys, hidden=None if items.hidden is None else next(it))

        whole = items_of(plan.whole)
        small = None if plan.small is None else items_of(plan.small)
        partial = items_of(plan.partial)
        order = None if plan.order is None else next(it)
        visible = None if plan.visible is None else next(it)
        return Step(tokens, positions, slots, logits_rows,
                    replace(plan, whole=whole, small=small, partial=partial, order=order, visible=visible),
                    self.wanted)


ATTENTION_ROWS = 16  # the least bucket of attention's rows (`lay_out`)


def pass_rows(config: LlamaConfig, kernels: Kernels, device: torch.device, n: int, buckets: bool) -> int:
    """The rows a pass of n tokens runs: whole units of the kernels' own padding (`Kernels.row_unit`: whole or
    short tiles of rows), their count a bucket with `buckets`."""
    unit = kernels.row_unit(device, config)
    whole = -(-max(n, 1) // unit)  # whole units of rows the tokens take
    return (bucket(whole) if buckets else whole) * unit


def lay_out(config: LlamaConfig, kernels: Kernels, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor,
            segments: torch.Tensor, logits_rows: torch.Tensor | None, buckets: bool, at_once: bool = False) -> Step:
    """The host half of a pass (`Llama.lay_out`): give the N new tokens cache slots and lay the step out (see
    the module's docstring) for a model of `config` with `kernels`; positions and segments are on the host.
    `at_once`: attention holds every item of the pass at once, however many (a compiled step's layout)."""
    n = tokens.shape[0]
    device = cache.k.device
    rows = pass_rows(config, kernels, device, n, buckets)
    g = config.num_attention_heads // config.num_key_value_heads
    slots = cache.append(segments, positions)  # (n,) a slot for each new token
    # Attention's rows need no whole linear tiles, only a bucket of their own (its ops on them are row-wise
    # and exact): a decode step of 64 tokens in a 256-row tile attends over 64 rows, not 256.
    attended = max(n, 1) if not buckets else bucket(max(n, 1), ATTENTION_ROWS)
    attended = min(rows, attended) if kernels.invariant else rows
    plan = plan_attention(cache, segments, positions, g, attended, kernels.tiles_for(device).attention,
                          dense=not kernels.invariant, window=config.sliding_window, buckets=buckets,
                          at_once=at_once)
    wanted = torch.arange(n) if logits_rows is None else logits_rows.cpu()
    logits = wanted.shape[0]
    padded_logits = bucket(logits) if buckets else logits
    pad = rows - n
    # Tokens may be on the device already (a decode step one ahead of the host takes the step before's choices
    # there: generate._decode); the rest is the host's, moved without waiting for the device (transfer.py).
    return Step(tokens=to_device(F.pad(tokens, (0, pad)), device),
                positions=to_device(F.pad(positions, (0, pad)), device),
                slots=to_device(F.pad(slots, (0, pad), value=SPILL_SLOT), device),
                logits_rows=to_device(F.pad(wanted, (0, padded_logits - logits)), device),
                plan=plan, wanted=logits)


def cuda_graph(run: Callable[[], torch.Tensor], pool: Any = None) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `run` as a CUDA graph in the memory pool `pool` (a `torch.cuda.graph_pool_handle()`; None: a
    pool of its own): (replay, its output buffer). The capture itself runs nothing."""
    graph = torch.cuda.CUDAGraph()
    # No garbage collection while capturing: it may free a dead cache's graphs, and destroying a graph is an
    # operation CUDA refuses while a stream captures, which invalidates this capture (seen on the H200).
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    finally:
        if collecting:
            gc.enable()
    return graph.replay, out


class CapturedSteps:
    """One cache storage's steps, captured per bucket: the first step of a bucket runs eagerly, the second is
    captured (`capture`: a CUDA graph) into static input buffers, and every later one copies its inputs into
    those buffers and replays (module docstring). It holds the storage (`k`, `v`), so that the graphs' memory
    outlives the cache it was made for and serves the next (`Steps.spare`)."""

    def __init__(self, cache: KVCache, capture: Callable = cuda_graph):
        self.k, self.v = cache.k, cache.v
        self.storage = cache.k.data_ptr()
        self.capture = capture
        # One memory pool for this storage's graphs, which live and die together. Never one pool for the whole
        # process: the caching allocator refuses to capture into a pool whose graphs have all died (its use
        # count is 0) while a block of it is still held.
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_graph else None
        self.seen: set[tuple] = set()
        self.graphs: dict[tuple, tuple[Callable[[], None], Step, torch.Tensor]] = {}  # key -> (replay, inputs, out)
        self.cache: KVCache | None = None  # the cache of the step under way, and only then

    def run(self, run_step: Callable[[KVCache, Step], torch.Tensor], cache: KVCache, step: Step,
            key: tuple = ()) -> torch.Tensor:
        """`key`: what else the launches follow (the kernels' settings), beside the step's shapes."""
        key = key + step.key()
        self.cache = cache  # what a captured function reads: never a cache it was captured for, gone since
        try:
            if key in self.graphs:
                replay, static, out = self.graphs[key]
                for buffer, value in zip(static.tensors(), step.tensors()):
                    buffer.copy_(value, non_blocking=True)
            elif key not in self.seen:
                self.seen.add(key)
                return run_step(cache, step)
            else:
                static = step.with_tensors([t.clone() for t in step.tensors()])
                replay, out = self.capture(lambda: run_step(self.cache, static), self.pool)
                self.graphs[key] = (replay, static, out)
            replay()
            return out
        finally:
            self.cache = None


COMPILED_SHAPES = 256  # the most layer graphs (step shapes) a process compiles before a new shape raises


def run_block(block: torch.nn.Module, *args: Any) -> torch.Tensor:
    """A decoder layer's forward: (block, x, cos, sin, k_cache, v_cache, slots, plan) -> x (model.Block)."""
    return block(*args)


def compile_block() -> Callable[..., torch.Tensor]:
    """`run_block` through `torch.compile`: one graph (no break) and static shapes, so one compiled graph per
    bucket serves every layer (a layer's weights and cache are its inputs; nothing in it names the layer),
    of any model of the same shapes. Its products and order-dependent reductions are opaque ops that run as
    they do eagerly (proofs.opaque); Inductor fuses the elementwise work between them, and its
    batch-invariant mode is asked for where this torch has it. A shape past
    `COMPILED_SHAPES` raises rather than falls back to eager ops, whose bits are not the compiled ones.
    Compiled code is kept on disk ($TORCHINDUCTOR_CACHE_DIR; unset, minillama's cache directory), so that a
    second process loads each shape rather than compiles it cold."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    keep_compiled_code()
    options = {"batch_invariant": True} if hasattr(inductor_config, "batch_invariant") else {}
    compiled = torch.compile(run_block, fullgraph=True, dynamic=False, options=options)
    limits = {name: value for name, value in (("recompile_limit", COMPILED_SHAPES),
                                              ("fail_on_recompile_limit_hit", True)) if hasattr(dynamo_config, name)}

    def run(block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, *rest: Any) -> torch.Tensor:
        # The cache's slot count is the one size compiled as a symbol: a cache of any capacity takes the same
        # graphs (a slot is only gathered and written, never summed over).
        torch._dynamo.mark_dynamic(k_cache, 1)
        torch._dynamo.mark_dynamic(v_cache, 1)
        try:
            with dynamo_config.patch(limits):
                return compiled(block, x, cos, sin, k_cache, v_cache, *rest)
        except Exception as e:
            raise no_compiler(e) or e
    return run


# Compiled steps are the exact path made fast; the plain kernels (the negative control: a mask over every cache
# slot, whose count a compiled graph holds as a symbol) run eagerly.
PLAIN_COMPILED = "--compile takes the batch-invariant kernels: drop --plain-kernels or --compile"


def keep_compiled_code() -> None:
    """Compiled code goes to $TORCHINDUCTOR_CACHE_DIR; where that is unset, or torch's temporary default (torch
    sets the variable when it is first imported), to minillama's cache directory, which outlives a reboot. A
    folder that cannot be made is said here, not deep in a compile, where it would read as the checkpoint's."""
    from .weights.default import user_cache_dir

    where, source = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "$TORCHINDUCTOR_CACHE_DIR"
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # it makes the folder `where` names

        if where in (None, os.path.abspath(default_cache_dir())):
            where = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(user_cache_dir() / "inductor")
            source = "$XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "$HOME"
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--compile: the compile cache {where} (from {source}) cannot be made ({e.strerror or e}); "
                       "set TORCHINDUCTOR_CACHE_DIR to a writable folder") from None


def no_compiler(e: Exception) -> BadInput | None:
    """Where a compile failed for want of a working compiler (C++ on a CPU, Triton on a GPU), not for the code
    compiled, the BadInput to raise instead: one line that says what is missing and the way out. Asked only
    once something failed, so a step's layers pay nothing for it."""
    import torch._inductor.exc as exc

    lacking = tuple(getattr(exc, name) for name in ("InvalidCxxCompiler", "CppCompileError", "TritonMissing",
                                                    "GPUTooOldForTriton") if hasattr(exc, name))
    cause = getattr(e, "inner_exception", e)
    if not isinstance(cause, lacking):
        return None
    said = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")[:200]
    error = BadInput(f"--compile: torch.compile cannot build code here ({type(cause).__name__}: {said}); install "
                     "a working compiler (a C++ compiler with Python's headers on a CPU, Triton on a GPU) or run "
                     "without --compile")
    error.__cause__ = e
    return error


def check_compiler(device: torch.device | str) -> None:
    """Compile and run one small function on `device`, so that a missing compiler shows when a model is
    loaded (`--compile`), not at its first step (BadInput, `no_compiler`). Kept in the compile
    cache like the layers, so it costs a compile once per machine."""
    keep_compiled_code()
    try:
        torch.compile(_probe, fullgraph=True, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:
        raise no_compiler(e) or e


def _probe(x: torch.Tensor) -> torch.Tensor:
    return (x * 2 + 1).sum()


# Every new model's `Steps.overlap` (None: by device). bench.gpu_check sets it False for the rest of a check
# whose first step found decoding ahead of the host broken on that GPU, so the loan's other figures survive.
OVERLAP: bool | None = None


class Steps:
    """How a model runs its steps: eagerly, or captured per bucket (`captured`: None, the default, captures
    on CUDA in one process; False never; True asks for it). `capture` is how (CUDA graphs; a test may give
    a stand-in that replays by running the step again, to check the buffers on a CPU). `compiled`: every step
    runs its layers through `torch.compile` (`compile_block`), laid out in buckets with its attention items
    held at once, captured or not as above; off by default."""

    lock = threading.RLock()  # every model's spare and `calls`, between threads (re-entered by a cache's finalizer)

    def __init__(self, kernels: Kernels):
        self.kernels = kernels  # the model's: a tensor-parallel rank's collectives run eagerly
        self.captured: bool | None = None
        self.capture: Callable = cuda_graph
        self._compiled = False  # `compiled`
        self._compiled_block: Callable | None = None
        # Each live cache's captured steps, in a box that follows it when it grows (a new storage).
        self._by_cache: weakref.WeakKeyDictionary[KVCache, list[CapturedSteps]] = weakref.WeakKeyDictionary()
        self.spare: CapturedSteps | None = None  # the last finished cache's storage and graphs
        self.overlap: bool | None = OVERLAP  # decoding one step ahead of the host (`overlapping`); None: by device
        self.calls: set[object] = set()  # generate calls and serving engines under way, in every thread (`answering`)

    def answering(self, call: object) -> None:
        """`call` (one object per generate call or engine loop) is under way, and the kernels' switches refuse to
        change (`unchanged`), until its caller's `finally` discards it first thing (a Ctrl-C leaves no call behind)."""
        with self.lock:
            self.calls.add(call)

    compiled = property(lambda self: self._compiled, doc="Every step's layers through torch.compile (`compile_block`).")

    @compiled.setter
    def compiled(self, on: bool) -> None:
        with self.lock:  # refused under a call, as `Llama.invariant` is: compiled bits are not eager bits
            self.unchanged("steps.compiled")
            self._compiled = on

    def unchanged(self, name: str) -> None:
        """Refuse (RuntimeError) to change `name` while `answering`; called with the lock held."""
        if self.calls:
            raise RuntimeError(f"model.{name} cannot change while generate() or a serving engine is answering on this "
                               "model (in another thread, or from a callback): answers would mix two kinds of kernels")

    def capturing(self, device: torch.device) -> bool:
        """Whether the model's steps on `device` are captured (in buckets) now."""
        if self.captured is False or self.kernels.sharded:
            return False
        if device.type == "cuda" or (self.captured and self.capture is not cuda_graph):
            return True
        if self.captured:
            raise ValueError(f"captured steps need a CUDA device; the model is on {device.type}")
        return False

    @property
    def block(self) -> Callable[..., torch.Tensor]:
        """How the device half runs each decoder layer: `run_block`, or it compiled (`compile_block`)."""
        if not self.compiled:
            return run_block
        if self.kernels.sharded:
            raise ValueError("compiled steps run in one process: a tensor-parallel rank's steps run eagerly")
        if not self.kernels.invariant:
            raise BadInput(PLAIN_COMPILED)
        if self._compiled_block is None:
            self._compiled_block = compile_block()
        return self._compiled_block

    def overlapping(self, device: torch.device) -> bool:
        """Whether `generate` decodes one step ahead of the host on `device` (generate._decode): by default where
        the device runs apart from the host (a GPU), never on a tensor-parallel rank (its ranks agree on each
        step's tokens before the next); `overlap` True or False asks (the same bits either way)."""
        if self.kernels.sharded:
            return False
        return device.type == "cuda" if self.overlap is None else self.overlap

    def bucketed(self, device: torch.device) -> bool:
        """Whether steps on `device` are laid out in buckets: where they are captured or compiled."""
        return self.compiled or self.capturing(device)

    def forget(self) -> None:
        """Drop the spare storage and its graphs: the weights they read have moved (`Llama.column_major_`)."""
        with self.lock:  # (a cache retired meanwhile, by a thread or a finalizer here, leaves no stale spare)
            for box in list(self._by_cache.values()):
                box.clear()
            self.spare = None

    def take_spare(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device
                   ) -> CapturedSteps | None:
        """The spare, for a new cache of `shape` (L, Hkv, S, D): one of the same dtype, device, layers, heads
        and head size, with at least S slots; else None. The caller makes the cache on its storage (`attach`)."""
        with self.lock:  # one taker: two threads' caches on one storage would write each other's keys
            spare = self.spare
            if spare is None or spare.k.dtype != dtype or spare.k.device != device or not KVCache.holds(spare.k, shape):
                return None
            self.spare = None
            return spare

    def attach(self, cache: KVCache, captured: CapturedSteps) -> None:
        """`cache`, made on `captured`'s storage, replays its graphs."""
        assert captured.storage == cache.k.data_ptr(), "the cache is not on the spare's storage"
        self._track(cache, captured)

    def _track(self, cache: KVCache, captured: CapturedSteps) -> None:
        box = [captured]
        self._by_cache[cache] = box
        weakref.finalize(cache, self._retire, box)

    def _retire(self, box: list[CapturedSteps]) -> None:
        """A cache is gone: its storage and graphs become the spare (the previous spare's are freed)."""
        with self.lock:
            if box:
                self.spare = box[0]

    def run(self, run_step: Callable[[KVCache, Step], torch.Tensor], cache: KVCache, step: Step) -> torch.Tensor:
        """The step's logits (step.wanted, vocab); `run_step` is the model's device half (`Llama.run_step`)."""
        if self.compiled and not step.capturable:  # lay_out(at_once=True) holds every pass's items at once
            raise ValueError("a compiled step must hold its attention items at once (lay_out's at_once)")
        if not (self.capturing(cache.k.device) and step.capturable):
            return run_step(cache, step)[:step.wanted]
        box = self._by_cache.get(cache)
        if box is None:
            self._track(cache, captured := CapturedSteps(cache, self.capture))
        elif not box or box[0].storage != cache.k.data_ptr():  # forgotten, or the cache grew: new graphs
            box[:] = [captured := CapturedSteps(cache, self.capture)]
        else:
            captured = box[0]
        kernels = (self.kernels.invariant, self.kernels.tiles, self.kernels.units, self.compiled)
        return captured.run(run_step, cache, step, kernels)[:step.wanted].clone()
