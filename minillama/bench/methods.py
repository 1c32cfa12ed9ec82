"""The methods run by minillama itself: each takes the context and the question indices to run, and
returns a Measured."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..generate import SamplingParams, Stats, generate
from ..model import Llama
from .memory import PeakRSS
from .task import Task

METHODS = ("independent", "independent_plain", "batched", "seqbatch", "parallel", "parallel_plain", "hf_batched",
           "hf_prefix", "llamacpp")
# Methods whose work grows with questions x document: the ones --sample may cut down.
SAMPLED = ("independent", "independent_plain", "batched", "seqbatch", "hf_batched")

ADDITIVE = ("independent", "independent_plain")  # one run per question: a sum of slices is the whole run


@dataclass
class Measured:
    answers: dict[int, list[int]]  # question index -> generated token ids
    prefill_s: float
    decode_s: float
    cpu_s: float
    kv_bytes: int  # peak bytes of keys and values held
    rss_bytes: int  # peak resident memory above the start
    forward_passes: int
    decode_steps: int  # forward passes after prefill (per document batch, summed)
    setup_s: float = 0.0  # untimed set-up of the run (llama.cpp's context), reported beside the times
    contexts: int = 1  # llama.cpp contexts the questions were split into (its cap on sequences per context)

    @staticmethod
    def combine(parts: list["Measured"]) -> "Measured":
        """Parts of one method run one after another (slices of the questions, llama.cpp's contexts): the
        times, passes and contexts add up, the peaks are the largest part's."""
        answers: dict[int, list[int]] = {}
        for p in parts:
            answers.update(p.answers)
        return Measured(answers, sum(p.prefill_s for p in parts), sum(p.decode_s for p in parts),
                        sum(p.cpu_s for p in parts), max(p.kv_bytes for p in parts), max(p.rss_bytes for p in parts),
                        sum(p.forward_passes for p in parts), sum(p.decode_steps for p in parts),
                        setup_s=sum(p.setup_s for p in parts), contexts=sum(p.contexts for p in parts))


@dataclass
class Context:
    model: Llama
    tokenizer: Any
    hf_path: str | None  # an HF directory with these weights, for the transformers methods
    checkpoint: str | None = None  # where the weights were read from; None: random weights
    workdir: Path | None = None  # scratch space of the run (files written from random weights)
    prefill_chunk: int = 512
    _hf: Any = None
    _llamacpp: Any = None  # the llama.cpp model, loaded once (bench.llamacpp)

    def hf(self) -> Any:
        if self._hf is None:
            from transformers import LlamaForCausalLM

            self._hf = LlamaForCausalLM.from_pretrained(self.hf_path, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
            # Never stop on EOS, and never suppress it (min_new_tokens would): as ignore_eos here.
            self._hf.generation_config.eos_token_id = None
        return self._hf


def _minillama(mode: str, invariant: bool) -> Callable[..., Measured]:
    def run(ctx: Context, task: Task, idx: list[int], parallel_size: int | None = None,
            batch_docs: int | None = None) -> Measured:
        prompts = [task.prompts[i] for i in idx]
        # batched: each prompt its own document, so each is a separate root segment holding its own copy
        # of the document's KV; all of them go through one packed prefill and decode together.
        docs = list(range(len(idx))) if mode == "batched" else [task.docs[i] for i in idx]
        st = Stats()
        params = SamplingParams(max_new_tokens=task.config.new_tokens, ignore_eos=True)
        saved = ctx.model.invariant
        ctx.model.invariant = invariant
        cpu0 = time.process_time()
        try:
            with PeakRSS() as mem:
                answers = generate(ctx.model, prompts, params, mode="parallel" if mode == "batched" else mode,
                                   docs=docs, parallel_size=parallel_size, batch_docs=batch_docs,
                                   prefill_chunk=ctx.prefill_chunk, stats=st)
        finally:
            ctx.model.invariant = saved
        return Measured({i: a.token_ids for i, a in zip(idx, answers)}, st.prefill_s, st.decode_s,
                        time.process_time() - cpu0, st.peak_kv_bytes, mem.delta, st.forward_passes,
                        _decode_steps(mode, docs, task.config.new_tokens, parallel_size, batch_docs))
    return run


def _decode_steps(mode: str, docs: list[int], g: int, parallel_size: int | None, batch_docs: int | None) -> int:
    """Forward passes after the prefill: EOS is ignored, so every question takes g - 1 decode steps."""
    if mode in ("independent", "seqbatch"):
        return len(docs) * (g - 1)
    if mode == "batched":
        return g - 1
    order = list(dict.fromkeys(docs))
    per = batch_docs or len(order)
    waves = 0
    for b in range(0, len(order), per):
        sizes = [docs.count(d) for d in order[b:b + per]]
        waves += max(math.ceil(n / (parallel_size or n)) for n in sizes)
    return waves * (g - 1)
