"""HF transformers as peers: batched `generate`, and `generate` on a document KV cache computed once."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from ..generate import shared_prefix_length
from .memory import PeakRSS
from .methods import Context, Measured
from .task import Task


class _Clock:
    """A logits processor that only records when each generation step's logits arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def _cache_bytes(cache: Any) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def _hf_generate(hf: Any, ids: torch.Tensor, mask: torch.Tensor, g: int, cache: Any = None) -> tuple:
    from transformers import LogitsProcessorList

    clock = _Clock()
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=g,
                      do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                      return_dict_in_generate=True)
    t1 = time.perf_counter()
    return out, clock.times[0] - t0, t1 - clock.times[0]


def hf_batched(ctx: Context, task: Task, idx: list[int], **_: Any) -> Measured:
    hf, g = ctx.hf(), task.config.new_tokens
    prompts = [task.prompts[i] for i in idx]
    m = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (m - len(p)) + p for p in prompts])  # (B, m), left-padded
    mask = torch.tensor([[0] * (m - len(p)) + [1] * len(p) for p in prompts])
    cpu0 = time.process_time()
    with PeakRSS() as mem, torch.inference_mode():
        out, pre, dec = _hf_generate(hf, ids, mask, g)
    seqs = out.sequences[:, m:].tolist()
    return Measured(dict(zip(idx, seqs)), pre, dec, time.process_time() - cpu0,
                    _cache_bytes(out.past_key_values), mem.delta, g, g - 1)


def hf_prefix(ctx: Context, task: Task, idx: list[int], parallel_size: int | None = None, **_: Any) -> Measured:
    """The document's KV computed once per document, copied into every row (DynamicCache
    `batch_repeat_interleave`); each row's question tokens follow it, padded in the middle so that the
    mask-derived positions continue the document's."""
    hf, g = ctx.hf(), task.config.new_tokens
    answers: dict[int, list[int]] = {}
    pre = dec = 0.0
    kv = passes = steps = 0
    cpu0 = time.process_time()
    with PeakRSS() as mem, torch.inference_mode():
        for d in dict.fromkeys(task.docs[i] for i in idx):
            q = [i for i in idx if task.docs[i] == d]
            group = [task.prompts[i] for i in q]
            shared = shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1
            t0 = time.perf_counter()
            doc_cache = hf(input_ids=torch.tensor([group[0][:shared]]), use_cache=True).past_key_values
            pre += time.perf_counter() - t0
            passes += 1
            size = parallel_size or len(q)
            for lo in range(0, len(q), size):
                wave = list(range(lo, min(lo + size, len(q))))
                t0 = time.perf_counter()
                cache = copy.deepcopy(doc_cache)
                cache.batch_repeat_interleave(len(wave))
                copy_s = time.perf_counter() - t0
                sufs = [group[j][shared:] for j in wave]
                m = max(len(s) for s in sufs)
                ids = torch.tensor([group[0][:shared] + [0] * (m - len(s)) + s for s in sufs])
                mask = torch.tensor([[1] * shared + [0] * (m - len(s)) + [1] * len(s) for s in sufs])
                out, p, dd = _hf_generate(hf, ids, mask, g, cache)
                pre += copy_s + p
                dec += dd
                passes += g
                steps += g - 1
                kv = max(kv, _cache_bytes(doc_cache) + _cache_bytes(out.past_key_values))
                for j, s in zip(wave, out.sequences[:, shared + m:].tolist()):
                    answers[q[j]] = s
    return Measured(answers, pre, dec, time.process_time() - cpu0, kv, mem.delta, passes, steps)
