"""llama.cpp as a peer: its fastest way to answer many questions that share a document, on the same token
ids and the same weights (an F32 GGUF, `gguf_f32`), through llama-cpp-python's low-level API.

Optional: without llama-cpp-python the bench skips the method with a note (`available()`).

What the method does, per run:

1. one llama.cpp context sized for the run (every question its own sequence, one unified KV cache, F16
   keys and values: llama.cpp's defaults), created and warmed up outside the timed region and freed
   after it, as a server would hold one; past llama.cpp's cap of 256 sequences in a context, as few
   contexts as the cap allows, of even sizes (`contexts`), run one after another, their times added;
2. each document's shared prefix decoded once, in the sequence of its first question, then shared with
   its other questions' sequences (`llama_memory_seq_cp`: in the unified cache the prefix's cells are
   given more sequence ids, nothing is copied);
3. every question's own tokens in one batch, logits at each question's last token;
4. one batch per decode step holding the next token of every question; greedy (first maximal logit) on
   llama.cpp's own logits, EOS ignored, like every method of the bench.

Timed from the first decode to the last argmax: steps 2-3 are the prefill, step 4 the decode. The model is
loaded once per bench process. On CPUs with AMX, llama.cpp's extra buffer types crash in `llama_decode`
(a llama.cpp bug), so the model is loaded without them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..generate import shared_prefix_length
from .memory import PeakRSS
from .methods import Context, Measured
from .task import Task

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: at most this many questions in one context
ERROR_LEVEL = 4  # GGML_LOG_LEVEL_ERROR


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


_log_callback: Any = None  # kept referenced: llama.cpp holds a pointer to it


def _quiet_logs() -> None:
    """llama.cpp logs every load and context at length on stderr: keep its errors only."""
    global _log_callback
    import llama_cpp as L

    if _log_callback is None:
        @L.llama_log_callback
        def errors_only(level: int, text: bytes, user_data: Any) -> None:
            if level == ERROR_LEVEL:
                sys.stderr.write(text.decode(errors="replace"))

        _log_callback = errors_only
        L.llama_log_set(_log_callback, ctypes.c_void_p(0))


class Model:
    """A GGUF file loaded by llama.cpp (weights only; contexts are made per run)."""

    def __init__(self, path: str | Path):
        import llama_cpp as L

        _quiet_logs()
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.use_extra_bufts = False  # the AMX buffer type crashes llama_decode on this kind of CPU
        self.path = str(path)
        self.ptr = L.llama_model_load_from_file(self.path.encode(), params)
        if not self.ptr:
            raise RuntimeError(f"{path}: llama.cpp could not load this GGUF file")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.ptr))


class Session:
    """One llama.cpp context: `decode` a batch of (token, position, sequence, wants logits) entries, read
    the logits of a batch row, share a sequence's cells with another sequence."""

    def __init__(self, model: Model, n_ctx: int, n_batch: int, n_seq: int, threads: int):
        import llama_cpp as L

        if n_seq > MAX_SEQUENCES:
            raise ValueError(f"llama.cpp runs at most {MAX_SEQUENCES} sequences in one context, not {n_seq}")
        self.L, self.model = L, model
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, min(512, n_batch), n_seq
        p.n_threads = p.n_threads_batch = threads
        p.kv_unified = True  # one cache for all sequences: a shared prefix's cells are stored once
        self.ptr = L.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens, {n_seq} sequences")
        self.memory = L.llama_get_memory(self.ptr)
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.n_batch = n_batch

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        if len(entries) > self.n_batch:
            raise ValueError(f"a batch of {len(entries)} tokens in a context made for {self.n_batch}")
        b = self.batch
        for i, (token, pos, seq, wants_logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wants_logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits(self, i: int) -> np.ndarray:
        """(vocab,) float32 logits of batch row i of the last decode (a view: copy to keep)."""
        return np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ptr, i), shape=(self.model.n_vocab,))

    def share(self, src: int, dst: int) -> None:
        self.L.llama_memory_seq_cp(self.memory, src, dst, -1, -1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ptr)


def gguf_for(ctx: Context) -> Path:
    """The F32 GGUF of the context's weights: the checkpoint's, cached beside it; random weights are
    written to the run's scratch directory."""
    from .gguf_f32 import f32_gguf, write_f32_gguf

    if ctx.checkpoint is None:  # random weights
        return write_f32_gguf(ctx.model.config, ctx.model.state_dict(), ctx.workdir / "random.f32.gguf")
    return f32_gguf(ctx.checkpoint)


def _model(ctx: Context) -> Model:
    if ctx._llamacpp is None:
        ctx._llamacpp = Model(gguf_for(ctx))
        if ctx._llamacpp.n_vocab != ctx.model.config.vocab_size:
            raise RuntimeError(f"{ctx._llamacpp.path}: llama.cpp sees {ctx._llamacpp.n_vocab} tokens, the model "
                               f"{ctx.model.config.vocab_size}")
    return ctx._llamacpp


def contexts(n: int, cap: int = MAX_SEQUENCES) -> list[int]:
    """How many questions each llama.cpp context runs: as few contexts as the cap allows, sizes as even
    as possible (600 at a cap of 256: 200, 200, 200), so that no context is left with a small remainder."""
    if n < 1 or cap < 1:
        raise ValueError(f"contexts({n}, cap={cap}): both must be at least 1")
    k = -(-n // cap)  # ceil
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def chunks(idx: list[int], cap: int | None = None) -> list[list[int]]:
    """`idx` cut into consecutive runs of the sizes `contexts` gives (the questions of one context each)."""
    out, start = [], 0
    for size in contexts(len(idx), MAX_SEQUENCES if cap is None else cap):
        out.append(idx[start:start + size])
        start += size
    return out


def llamacpp(ctx: Context, task: Task, idx: list[int], **_: Any) -> Measured:
    """Every question of `idx`, in as many contexts as llama.cpp's cap on sequences requires, one after
    another: the times add up (each context's set-up outside them), each context decodes its documents'
    prefixes once, and the KV bytes are the largest context's."""
    return Measured.combine([_one_context(ctx, task, part) for part in chunks(idx)])


def _one_context(ctx: Context, task: Task, idx: list[int]) -> Measured:
    model, g = _model(ctx), task.config.new_tokens
    prompts = [task.prompts[i] for i in idx]
    groups: dict[int, list[int]] = {}  # document -> positions in idx of its questions
    for j, i in enumerate(idx):
        groups.setdefault(task.docs[i], []).append(j)
    shared = {d: (shared_prefix_length([prompts[j] for j in js]) if len(js) > 1 else len(prompts[js[0]]) - 1)
              for d, js in groups.items()}
    prefix_tokens = sum(shared.values())
    own_tokens = sum(len(p) for p in prompts) - sum(shared[task.docs[i]] for i in idx)
    cells = prefix_tokens + own_tokens + len(idx) * (g - 1)
    warm = prompts[0][:32]  # the first decode of a context sets up its buffers: not part of the timing
    n_batch = max(prefix_tokens, own_tokens, len(idx), len(warm))
    t0 = time.perf_counter()
    s = Session(model, n_ctx=cells + 256, n_batch=n_batch, n_seq=len(idx), threads=torch.get_num_threads())
    answers: list[list[int]] = [[] for _ in idx]
    try:
        s.decode([(t, pos, 0, pos == len(warm) - 1) for pos, t in enumerate(warm)])
        s.clear()
        setup_s = time.perf_counter() - t0
        cpu0 = time.process_time()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            # The prefixes, each once, in its document's first question's sequence; shared with the others.
            prefixes = [(t, pos, js[0], False) for d, js in groups.items()
                        for pos, t in enumerate(prompts[js[0]][:shared[d]])]
            if prefixes:
                s.decode(prefixes)
            for d, js in groups.items():
                for j in js[1:]:
                    s.share(js[0], j)
            # Every question's own tokens in one batch, logits at each one's last token.
            batch, last = [], []
            for j, p in enumerate(prompts):
                start = shared[task.docs[idx[j]]]
                batch += [(t, start + k, j, start + k == len(p) - 1) for k, t in enumerate(p[start:])]
                last.append(len(batch) - 1)
            s.decode(batch)
            for j in range(len(idx)):
                answers[j].append(int(np.argmax(s.logits(last[j]))))
            t1 = time.perf_counter()
            for step in range(1, g):
                s.decode([(answers[j][-1], len(p) + step - 1, j, True) for j, p in enumerate(prompts)])
                for j in range(len(idx)):
                    answers[j].append(int(np.argmax(s.logits(j))))
            t2 = time.perf_counter()
    finally:
        s.close()
    c = ctx.model.config
    kv_bytes = cells * c.kv_bytes_per_token(2)  # F16 keys and values
    return Measured(dict(zip(idx, answers)), t1 - t0, t2 - t1, time.process_time() - cpu0, kv_bytes, mem.delta,
                    (1 if prefixes else 0) + g, g - 1, setup_s=setup_s)
