"""Benchmarks: parallel prompting against the ways people answer many questions about one document.

    python -m minillama.bench              # default preset, a few minutes on 2 CPU cores
    python -m minillama.bench --quick      # tiny random model, seconds (the CI smoke run)
    python -m minillama.bench --full       # every method on every question, no extrapolation
    python -m minillama.bench --random     # random weights with the default model's shape (same speed)

The task is the synthetic one of the parallel-prompting paper, generated here: a document of filler text
holding facts "The {animal} named {name} has {part} that is {color}.", questions "What color is the
{part} of the {animal} named {name}?", and the color as the expected answer. Knobs: document length in
tokens, unique documents, questions per document, question length, answer length (max new tokens).
EOS is ignored, so every method generates the same number of tokens.

Methods, all on the same prompt token ids (`api.prompt_ids`, one stand-alone prompt per question):

- `independent`        each question alone, batch-invariant ops (the bit-exact reference)
- `independent_plain`  each question alone, `model.invariant = False` (plain F.linear + masked SDPA);
                       the faster of the two, so the headline baseline
- `batched`            every prompt its own root segment in one packed batch: the document's KV is
                       computed and stored once per question (what a batched `generate` user gets)
- `seqbatch`           the paper's baseline: one stream, document, q1, a1, q2, a2, ...
- `parallel`           the paper's method: document once, all questions in one packed prefill, then one
                       token per question per forward pass
- `parallel_plain`     parallel with `model.invariant = False`: what bit-exactness costs the method
- `hf_batched`         HF transformers `generate`, left-padded batch, fp32, SDPA, the same weights
- `hf_prefix`          HF transformers with the document's KV cache computed once and copied into every
                       row of the batch (`past_key_values`), the questions middle-padded after it

Measured per method: wall time of generation (model load excluded), prefill and decode apart, process
CPU time, generated tokens/s, peak resident memory above the start of the run, KV-cache bytes, answers
that contain the color, answers token-identical to `independent`. FLOPs are counted analytically
(`CostModel`); the machine's fp32 GEMM rate is measured in the same run and each method's useful FLOP/s
is reported as a fraction of it. Methods are run round-robin, repeat after repeat, and the medians are
reported: this machine is noisy, so compare ratios taken within one run.

Methods whose cost grows with the number of questions times the document (all but parallel and
hf_prefix) can run on a sample of the questions (`--sample K`): their times, FLOPs and (for batches) KV
bytes are then scaled by n / K and the record says `measured_questions`. Each question of `independent`
is a separate run, so for it the scaling is exact; for a batch, or seqbatch's shorter stream, it is an
estimate. `--full` samples nothing in the headline.

Outputs under --out (default bench_results/): results.json (everything), results.csv (one row per
sweep point and method), summary.md (tables), and PNG plots.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import json
import math
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .config import LlamaConfig
from .generate import SamplingParams, Stats, generate, shared_prefix_length
from .model import Llama

METHODS = ("independent", "independent_plain", "batched", "seqbatch", "parallel", "parallel_plain", "hf_batched",
           "hf_prefix")
# Methods whose work grows with questions x document: the ones --sample may cut down.
SAMPLED = ("independent", "independent_plain", "batched", "seqbatch", "hf_batched")

# ------------------------------------------------------------------------------------------------------
# The synthetic task

ANIMALS = ["cat", "dog", "horse", "rabbit", "fox", "owl", "goat", "sheep", "duck", "mouse", "tiger", "bear",
           "wolf", "deer", "frog", "lion", "camel", "otter", "eagle", "parrot"]
NAMES = ["Bob", "Alice", "Max", "Luna", "Oscar", "Daisy", "Leo", "Ruby", "Felix", "Rosa", "Hugo", "Nina",
         "Otto", "Ivy", "Jack", "Mia", "Sam", "Lily", "Tom", "Zoe", "Ben", "Ella", "Finn", "Lucy"]
PARTS = ["tail", "nose", "ears", "eyes", "paws", "fur", "neck", "feet", "back", "belly"]
COLORS = ["red", "blue", "green", "yellow", "orange", "purple", "pink", "brown", "black", "white", "gray"]
# Filler: sentences from a small grammar, with no colors, animals or names in them.
_SUBJECTS = ["The old bridge", "A quiet village", "The morning train", "The river", "A small bakery",
             "The market square", "The library", "An empty road", "The north wind", "The harbour",
             "A wooden fence", "The school bell", "The town clock", "A long meeting", "The garden"]
_VERBS = ["stood still", "was busy", "seemed calm", "grew louder", "stayed open", "was closed",
          "looked different", "was quiet", "felt warm", "was crowded", "moved slowly", "was repaired"]
_TIMES = ["that morning", "in the evening", "after the rain", "during the festival", "before noon",
          "all week", "on Sunday", "in early spring", "late at night", "for a while"]
# Lead-ins that make repeated questions about one fact distinct prompts, and the words that lengthen a
# question to the requested token count.
_LEADS = ["", "Please answer:", "Quick question:", "From the text,", "According to the story,",
          "Tell me,", "In the text,", "One more:"]
_PAD_WORDS = ("Answer with the color only, in one word, as it is written in the text above, and say nothing "
              "else at all about the animal, its name or the rest of the story.").split()


@dataclass(frozen=True)
class TaskConfig:
    doc_tokens: int = 512  # tokens of document text (approximate: whole sentences)
    n_docs: int = 1  # unique documents
    questions_per_doc: int = 64
    question_tokens: int = 0  # at least this many tokens of question text (instruction words appended);
    # 0: the natural question, 11 to 15 tokens with SmolLM2's tokenizer (the paper's ~12)
    new_tokens: int = 8  # answer length: max new tokens, EOS ignored
    seed: int = 0


@dataclass
class Task:
    config: TaskConfig
    prompts: list[list[int]]  # one stand-alone prompt per question
    docs: list[int]  # document index of each prompt
    colors: list[str]  # expected answer of each prompt
    doc_texts: list[str]
    questions: list[str]

    @property
    def n(self) -> int:
        return len(self.prompts)


def _facts(rng: random.Random, k: int) -> list[tuple[str, str, str, str]]:
    """k facts (animal, name, part, color); each (animal, name, part) appears once."""
    seen: set[tuple[str, str, str]] = set()
    out = []
    while len(out) < k:
        a, nm, p = rng.choice(ANIMALS), rng.choice(NAMES), rng.choice(PARTS)
        if (a, nm, p) not in seen:
            seen.add((a, nm, p))
            out.append((a, nm, p, rng.choice(COLORS)))
    return out


def _fact_sentence(a: str, nm: str, p: str, c: str) -> str:
    verb = "are" if p.endswith("s") or p == "feet" else "is"
    return f"The {a} named {nm} has {p} that {verb} {c}."


def make_task(tokenizer: Any, config: TaskConfig, prompt_ids: Callable[[str, str], list[int]]) -> Task:
    """Documents, questions and prompts. One fact per ~48 document tokens (at most one per question);
    questions go round the facts, a lead-in distinguishing repeated ones."""
    rng = random.Random(config.seed)
    n_tok = lambda s: len(tokenizer.encode(" " + s))  # noqa: E731
    prompts, docs, colors, texts, questions = [], [], [], [], []
    for d in range(config.n_docs):
        n_facts = max(1, min(config.questions_per_doc, config.doc_tokens // 48))
        facts = _facts(rng, n_facts)
        sentences = [_fact_sentence(*f) for f in facts]
        used = sum(n_tok(s) for s in sentences)
        filler: list[str] = []
        while used < config.doc_tokens:
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_TIMES)}."
            filler.append(s)
            used += n_tok(s)
        # Facts spread evenly through the filler, at random offsets.
        slots = sorted(rng.sample(range(len(filler) + len(sentences)), len(sentences)))
        body, fi, si = [], 0, 0
        for i in range(len(filler) + len(sentences)):
            if si < len(slots) and slots[si] == i:
                body.append(sentences[si])
                si += 1
            else:
                body.append(filler[fi])
                fi += 1
        text = " ".join(body)
        texts.append(text)
        for q in range(config.questions_per_doc):
            a, nm, p, c = facts[q % n_facts]
            lead = _LEADS[(q // n_facts) % len(_LEADS)]
            core = f"What color is the {p} of the {a} named {nm}?"
            question = f"{lead} {core}".strip()
            words = 0
            while n_tok(question) < config.question_tokens and words < len(_PAD_WORDS):
                words += 1
                question = f"{lead} {core} {' '.join(_PAD_WORDS[:words])}".strip()
            prompts.append(prompt_ids(text, question))
            docs.append(d)
            colors.append(c)
            questions.append(question)
    return Task(config, prompts, docs, colors, texts, questions)


class WordTokenizer:
    """A stand-in tokenizer for random-weight runs: one id per word or punctuation mark (crc32 hash), so
    token counts look like text and decode gives the words back. No chat template."""

    chat_template = None
    bos_id = None
    eos_ids: list[int] = []

    def __init__(self, vocab_size: int, reserved: int = 3):
        self.vocab = vocab_size
        self.reserved = reserved
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        ids = []
        for w in re.findall(r"\w+|[^\w\s]|\n", text):
            i = self.reserved + zlib.crc32(w.encode()) % (self.vocab - self.reserved)
            self.words.setdefault(i, w)
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return " ".join(self.words.get(i, f"<{i}>") for i in ids)


def plain_prompt_ids(tokenizer: Any) -> Callable[[str, str], list[int]]:
    """The project's prompt (`api.prompt_ids`): chat template when the tokenizer has one."""
    from .api import prompt_ids

    return lambda doc, q: prompt_ids(tokenizer, doc, q)


# ------------------------------------------------------------------------------------------------------
# What the work costs: FLOPs counted from the shapes, and what this machine can do


class CostModel:
    """Analytic FLOPs of a Llama: per token through the stack, 2 * params of every linear layer and
    4 * D * keys per query head for attention (q.k and p.v); 2 * params of the LM head per logits row."""

    def __init__(self, c: LlamaConfig):
        h, d, hq, hkv, f = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, \
            c.intermediate_size
        self.layers = c.num_hidden_layers
        self.linear = 2 * (h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * f)  # per token per layer
        self.attn_per_key = 4 * d * hq  # per token per layer per visible key
        self.head = 2 * h * c.vocab_size

    def span(self, start: int, n: int) -> float:
        """n tokens at positions start .. start+n-1, each seeing every earlier position and itself."""
        keys = n * start + n * (n + 1) / 2
        return self.layers * (self.linear * n + self.attn_per_key * keys)

    def step(self, keys: int) -> float:
        """One token that sees `keys` keys, and its logits row."""
        return self.layers * (self.linear + self.attn_per_key * keys) + self.head

    def independent(self, prompts: Sequence[Sequence[int]], g: int) -> float:
        return sum(self.span(0, len(p) + g - 1) + g * self.head for p in prompts)

    def parallel(self, prompts: Sequence[Sequence[int]], docs: Sequence[int], g: int) -> dict[str, float]:
        """The least work that answers every question exactly: each document once. Split into prefill
        (documents, questions, first logits row) and decode (the other g - 1 tokens)."""
        pre = dec = 0.0
        for d in dict.fromkeys(docs):
            group = [p for p, dd in zip(prompts, docs) if dd == d]
            shared = shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1
            pre += self.span(0, shared)
            for p in group:
                pre += self.span(shared, len(p) - shared) + self.head
                dec += sum(self.step(len(p) + t + 1) for t in range(g - 1))
        return {"prefill": pre, "decode": dec, "total": pre + dec}

    def seqbatch(self, prompts: Sequence[Sequence[int]], docs: Sequence[int], g: int) -> float:
        total = 0.0
        for d in dict.fromkeys(docs):
            group = [p for p, dd in zip(prompts, docs) if dd == d]
            shared = shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1
            length = shared + sum(len(p) - shared + g for p in group)
            total += self.span(0, length - 1) + len(group) * g * self.head
        return total

    def hf_batched(self, prompts: Sequence[Sequence[int]], g: int) -> float:
        """Left-padded: every row runs max-length tokens."""
        m = max(len(p) for p in prompts)
        return len(prompts) * (self.span(0, m + g - 1) + g * self.head)

    def hf_prefix(self, prompts: Sequence[Sequence[int]], docs: Sequence[int], g: int) -> float:
        total = 0.0
        for d in dict.fromkeys(docs):
            group = [p for p, dd in zip(prompts, docs) if dd == d]
            shared = shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1
            m = max(len(p) for p in group) - shared
            total += self.span(0, shared) + len(group) * (self.span(shared, m + g - 1) + g * self.head)
        return total


def gemm_rate(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """fp32 GFLOP/s of one (m, k) @ (k, n) matmul on this machine: the median of `repeats`."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.matmul(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every few milliseconds (Linux /proc)."""

    def __init__(self, interval: float = 0.003):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.base = self._rss()
        self.peak = self.base
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


# ------------------------------------------------------------------------------------------------------
# The methods. Each takes the context and the question indices to run, and returns a Measured.


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


@dataclass
class Context:
    model: Llama
    tokenizer: Any
    hf_path: str | None  # an HF directory with these weights, for the transformers methods
    prefill_chunk: int = 512
    _hf: Any = None

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


RUNNERS: dict[str, Callable[..., Measured]] = {
    "independent": _minillama("independent", True),
    "independent_plain": _minillama("independent", False),
    "batched": _minillama("batched", True),
    "seqbatch": _minillama("seqbatch", True),
    "parallel": _minillama("parallel", True),
    "parallel_plain": _minillama("parallel", False),
    "hf_batched": hf_batched,
    "hf_prefix": hf_prefix,
}


# ------------------------------------------------------------------------------------------------------
# One sweep point: a task, several methods, round-robin repeats, medians


@dataclass
class Case:
    sweep: str
    task: TaskConfig
    methods: tuple[str, ...]
    sample: int | None = None  # run SAMPLED methods on this many questions and scale
    once: tuple[str, ...] = ()  # methods run in the first repeat only (long ones)
    parallel_size: int | None = None
    batch_docs: int | None = None
    label: str = ""


def _sample(task: Task, k: int | None) -> list[int]:
    """k question indices spread evenly over all questions (and so over the documents)."""
    n = task.n
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(j * n / k) for j in range(k)})


def _flops(cost: CostModel, method: str, task: Task, idx: list[int]) -> float:
    prompts, docs, g = [task.prompts[i] for i in idx], [task.docs[i] for i in idx], task.config.new_tokens
    if method in ("independent", "independent_plain", "batched"):
        return cost.independent(prompts, g)
    if method == "parallel":
        return cost.parallel(prompts, docs, g)["total"]
    if method == "seqbatch":
        return cost.seqbatch(prompts, docs, g)
    if method == "hf_batched":
        return cost.hf_batched(prompts, g)
    return cost.hf_prefix(prompts, docs, g)


def run_case(ctx: Context, case: Case, repeats: int, reference: dict[tuple[int, tuple[int, ...]], list[int]],
             gemm: list[float], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every method of the case `repeats` times, round-robin; one record per method (medians).

    `reference` maps (new tokens, prompt) to the prompt's `independent` answer; it fills as independent runs
    and is what the identity column is checked against, across cases.
    """
    task = make_task(ctx.tokenizer, case.task, plain_prompt_ids(ctx.tokenizer))
    cost = CostModel(ctx.model.config)
    g = case.task.new_tokens
    useful = cost.parallel(task.prompts, task.docs, g)
    per: dict[str, list[Measured]] = {m: [] for m in case.methods}
    idx_of = {m: (_sample(task, case.sample) if m in SAMPLED else list(range(task.n))) for m in case.methods}
    # A long run-once method made of separate runs (each question alone) is cut into `repeats` slices, one
    # per round, so that it meets the same machine weather as the repeated methods it is compared with.
    sliced = {m: [idx_of[m][k::repeats] for k in range(repeats)] for m in case.once if m in ADDITIVE}
    for r in range(repeats):
        gemm.append(gemm_rate())
        for m in case.methods:
            if m in sliced:
                idx = sliced[m][r]
            elif m in case.once and r > 0:
                continue
            else:
                idx = idx_of[m]
            if not idx:
                continue
            kw = {"parallel_size": case.parallel_size, "batch_docs": case.batch_docs} if m in (
                "parallel", "hf_prefix") else {}
            res = RUNNERS[m](ctx, task, idx, **kw)
            per[m].append(res)
            if m == "independent":
                for i, a in res.answers.items():
                    reference.setdefault((g, tuple(task.prompts[i])), a)
            log(f"  {case.sweep} {case.label} {m} {'slice' if m in sliced else 'repeat'} {r + 1}/{repeats}: "
                f"{res.prefill_s + res.decode_s:.2f} s ({len(idx)} questions)")
    for m in sliced:
        per[m] = [_combine(per[m])]
    rate = statistics.median(gemm[-repeats:]) * 1e9
    records = []
    for m in case.methods:
        runs, idx = per[m], idx_of[m]
        scale = task.n / len(idx)
        med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
        prefill, decode = med(lambda x: x.prefill_s) * scale, med(lambda x: x.decode_s) * scale
        wall = med(lambda x: x.prefill_s + x.decode_s) * scale
        answers = runs[0].answers
        ref = {i: reference.get((g, tuple(task.prompts[i]))) for i in idx}
        checked = [i for i in idx if ref[i] is not None]
        eos = ctx.model.config.eos_token_ids
        correct = sum(task.colors[i] in _answer_text(ctx.tokenizer, answers[i], eos).lower() for i in idx)
        stable = all(x.answers == answers for x in runs)
        flops = _flops(cost, m, task, idx) * scale
        kv_scale = scale if m in ("batched", "hf_batched") else 1.0
        rec = {
            "sweep": case.sweep, "label": case.label, **dataclasses.asdict(case.task),
            "doc_tokens_real": _mean_shared(task), "prompt_tokens_mean": statistics.mean(map(len, task.prompts)),
            "suffix_tokens_mean": statistics.mean(map(len, task.prompts)) - _mean_shared(task),
            "question_text_tokens_mean": statistics.mean(len(ctx.tokenizer.encode(q)) for q in task.questions),
            "questions": task.n, "method": m, "parallel_size": case.parallel_size, "batch_docs": case.batch_docs,
            "measured_questions": len(idx), "extrapolated": len(idx) < task.n, "repeats": len(runs),
            "wall_s": wall, "prefill_s": prefill, "decode_s": decode, "cpu_s": med(lambda x: x.cpu_s) * scale,
            "wall_s_min": min(x.prefill_s + x.decode_s for x in runs) * scale,
            "generated_tokens": task.n * g, "tokens_per_s": task.n * g / wall if wall else float("nan"),
            "decode_steps": runs[0].decode_steps, "forward_passes": runs[0].forward_passes,
            "decode_s_per_step": (med(lambda x: x.decode_s) / runs[0].decode_steps
                                  if runs[0].decode_steps and m not in SAMPLED else None),
            "kv_bytes": int(max(x.kv_bytes for x in runs) * kv_scale),
            "peak_rss_bytes": max(x.rss_bytes for x in runs),
            "accuracy": correct / len(idx),
            "identical_to_independent": sum(answers[i] == ref[i] for i in checked),
            "checked_against_independent": len(checked),
            "stable_across_repeats": stable,
            "flops_executed": flops, "flops_useful": useful["total"],
            "gemm_gflops": rate / 1e9,
            "useful_gflops": useful["total"] / wall / 1e9 if wall else float("nan"),
            "useful_frac_of_gemm": useful["total"] / wall / rate if wall else float("nan"),
            "executed_frac_of_gemm": flops / wall / rate if wall else float("nan"),
        }
        if m == "parallel":
            rec["prefill_flops"] = useful["prefill"]
            rec["prefill_frac_of_gemm"] = useful["prefill"] / prefill / rate if prefill else float("nan")
            rec["decode_flops_per_step"] = useful["decode"] / max(g - 1, 1) if g > 1 else 0.0
            # What `batched` would hold at its peak (every prompt and g - 1 answer tokens, each its own copy):
            # exact, as the cache stores one slot per token.
            c = ctx.model.config
            per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * ctx.model.dtype.itemsize
            rec["kv_bytes_batched_equiv"] = per_token * sum(len(p) + g - 1 for p in task.prompts)
        records.append(rec)
    base = {r["method"]: r["wall_s"] for r in records}
    for r in records:
        for ref_m in ("independent_plain", "independent", "hf_batched"):
            if ref_m in base:
                r[f"speedup_vs_{ref_m}"] = base[ref_m] / r["wall_s"]
    return records


def _combine(parts: list[Measured]) -> Measured:
    """Slices of one method run one after another: times add up, peaks are the largest slice's."""
    answers: dict[int, list[int]] = {}
    for p in parts:
        answers.update(p.answers)
    return Measured(answers, sum(p.prefill_s for p in parts), sum(p.decode_s for p in parts),
                    sum(p.cpu_s for p in parts), max(p.kv_bytes for p in parts), max(p.rss_bytes for p in parts),
                    sum(p.forward_passes for p in parts), sum(p.decode_steps for p in parts))


def _mean_shared(task: Task) -> float:
    out = []
    for d in dict.fromkeys(task.docs):
        group = [p for p, dd in zip(task.prompts, task.docs) if dd == d]
        out.append(shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1)
    return statistics.mean(out)


def _answer_text(tokenizer: Any, ids: list[int], eos: Sequence[int] = ()) -> str:
    """The answer's text up to its first EOS (EOS is ignored while generating, so text follows it)."""
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    return tokenizer.decode(ids[:cut])


# ------------------------------------------------------------------------------------------------------
# Presets: which cases make up a run


ALL = METHODS
SWEEP = ("independent", "independent_plain", "parallel")  # independent: the identity check; plain: the baseline
ONCE = ("independent",)  # in sweeps the reference run is only needed once
ADDITIVE = ("independent", "independent_plain")  # one run per question: a sum of slices is the whole run


def preset(name: str, hf: bool) -> tuple[list[Case], int]:
    """The cases of a preset and its repeats.

    quick: a tiny random model, every sweep at two points (CI). default: the paper's configuration with
    the costly methods on a few questions, small sweeps. full: every method on every question in the
    headline (the costly ones once, the others `repeats` times) and the sweeps at the paper's sizes.
    """
    methods = ALL if hf else tuple(m for m in ALL if not m.startswith("hf_"))
    cases: list[Case] = []
    if name == "quick":
        t = TaskConfig(doc_tokens=48, questions_per_doc=6, new_tokens=4)
        cases.append(Case("headline", t, methods, label="paper config, scaled down"))
        for n in (1, 2):
            cases.append(Case("docs", dataclasses.replace(t, n_docs=n, questions_per_doc=4), SWEEP, label=f"docs={n}"))
        for L in (32, 96):
            cases.append(Case("doclen", dataclasses.replace(t, doc_tokens=L), SWEEP, label=f"doc={L}"))
        for bd, ps in ((1, 2), (2, 4)):
            cases.append(Case("grid", dataclasses.replace(t, n_docs=2, questions_per_doc=4), ("parallel",),
                              parallel_size=ps, batch_docs=bd, label=f"batch={bd} parallel={ps}"))
        for q in (2, 8):
            cases.append(Case("questions", dataclasses.replace(t, questions_per_doc=q), SWEEP, label=f"q={q}"))
        return cases, 2
    full = name == "full"
    paper = TaskConfig(doc_tokens=512, questions_per_doc=64, new_tokens=8)
    cases.append(Case("headline", paper, methods, sample=None if full else 4, once=SAMPLED,
                      label="paper config"))
    # The same questions with 16 new tokens: SmolLM2-135M spends its first ~8 tokens restating the question.
    cases.append(Case("answer16", dataclasses.replace(paper, new_tokens=16), ("independent", "parallel"), sample=2,
                      once=ONCE, label="16 new tokens"))
    for n in (1, 2, 4) if not full else (1, 2, 4, 8):  # Fig. 4: unique documents
        cases.append(Case("docs", dataclasses.replace(paper, doc_tokens=256, n_docs=n, questions_per_doc=8 if not full
                                                      else 16), SWEEP, sample=2 * n, once=ONCE, label=f"docs={n}"))
    # Table 4, Figs 5-7: document length, at the paper's 64 questions (the long-document target: 512 -> 4096).
    lengths = (512, 1024, 2048, 4096) if not full else (128, 256, 512, 1024, 2048, 4096)
    for L in lengths:
        cases.append(Case("doclen", dataclasses.replace(paper, doc_tokens=L), SWEEP,
                          sample=1 if L >= 2048 else 2, once=ONCE, label=f"doc={L}"))
    grid = (((1, 4), (1, 16), (2, 4), (2, 16)) if not full
            else tuple((b, p) for b in (1, 2, 4) for p in (4, 8, 16)))
    for bd, ps in grid:  # Tables 3 and 5: batch size (documents per pass) x parallel size (questions per wave)
        cases.append(Case("grid", dataclasses.replace(paper, doc_tokens=256, n_docs=2 if not full else 4,
                                                      questions_per_doc=16), ("parallel",),
                          parallel_size=ps, batch_docs=bd, label=f"batch={bd} parallel={ps}"))
    for q in (8, 32, 64) if not full else (8, 16, 32, 64, 128):
        cases.append(Case("questions", dataclasses.replace(paper, doc_tokens=256, questions_per_doc=q), SWEEP,
                          sample=2, once=ONCE, label=f"q={q}"))
    return cases, (3 if full else 2)


# ------------------------------------------------------------------------------------------------------
# Output: CSV, JSON, markdown, plots


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{nd}f}" if abs(x) < 1e5 else f"{x:.3g}"
    return str(x)


def headline_table(records: list[dict[str, Any]]) -> str:
    rows = [r for r in records if r["sweep"] == "headline"]
    if not rows:
        return ""
    base = next((r for r in rows if r["method"] == "independent_plain"), rows[0])
    hf = next((r for r in rows if r["method"] == "hf_batched"), None)
    head = ("| method | wall s | prefill s | decode s | CPU s | tok/s | speedup vs independent (plain) | vs HF batched "
            "| KV MiB | peak RSS MiB | exact match | identical to independent | useful FLOP/s % of GEMM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["method"] + (f" (x{r['questions'] / r['measured_questions']:.0f} from {r['measured_questions']} q)"
                           if r["extrapolated"] else ""),
            _fmt(r["wall_s"]), _fmt(r["prefill_s"]), _fmt(r["decode_s"]), _fmt(r["cpu_s"]), _fmt(r["tokens_per_s"], 1),
            _fmt(base["wall_s"] / r["wall_s"], 1), _fmt(hf["wall_s"] / r["wall_s"], 1) if hf else "-",
            _fmt(r["kv_bytes"] / 2**20, 1), _fmt(r["peak_rss_bytes"] / 2**20, 0),
            f"{r['accuracy'] * 100:.0f}%",
            f"{r['identical_to_independent']}/{r['checked_against_independent']}",
            _fmt(100 * r["useful_frac_of_gemm"], 1)]) + " |")
    return "\n".join(lines)


def findings(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets of the brief, measured (reported, never asserted)."""
    out: dict[str, Any] = {}
    h = {r["method"]: r for r in records if r["sweep"] == "headline"}
    if "parallel" in h:
        p = h["parallel"]
        for m in ("independent_plain", "independent", "hf_batched", "hf_prefix", "batched", "seqbatch",
                  "parallel_plain"):
            if m in h:
                out[f"parallel_speedup_vs_{m}"] = h[m]["wall_s"] / p["wall_s"]
        # The same ratios in process CPU time: with one thread, time lost to other processes on a shared
        # machine is not counted, so these move less from run to run than the wall-clock ones.
        for m in ("independent_plain", "hf_batched"):
            if m in h:
                out[f"parallel_speedup_vs_{m}_cpu_time"] = h[m]["cpu_s"] / p["cpu_s"]
        if "batched" in h:
            out["kv_parallel_over_batched"] = p["kv_bytes"] / h["batched"]["kv_bytes"]
        if "hf_batched" in h:
            out["kv_parallel_over_hf_batched"] = p["kv_bytes"] / h["hf_batched"]["kv_bytes"]
        out["parallel_prefill_frac_of_gemm"] = p.get("prefill_frac_of_gemm")
        out["gemm_gflops"] = p["gemm_gflops"]
    d = {r["doc_tokens"]: r for r in records if r["sweep"] == "doclen" and r["method"] == "parallel"}
    if 512 in d and 4096 in d and d[512]["decode_s_per_step"]:
        t = d[4096]["decode_s_per_step"] / d[512]["decode_s_per_step"]
        f = d[4096]["decode_flops_per_step"] / d[512]["decode_flops_per_step"]
        out.update(decode_step_s_512=d[512]["decode_s_per_step"], decode_step_s_4096=d[4096]["decode_s_per_step"],
                   decode_step_time_growth=t, decode_step_flops_growth=f, decode_growth_over_flops_growth=t / f,
                   doclen_questions=d[4096]["questions"])
    for L, r in sorted(d.items()):
        out[f"kv_parallel_over_batched_doc{L}"] = r["kv_bytes"] / r["kv_bytes_batched_equiv"]
    if 4096 in d:
        # The KV target is about long documents: at 512 tokens the 64 questions' own tokens (prompt suffix and
        # answer, about 20 each) are already 1/30 of batched's cache, whatever the method does with the document.
        out["kv_parallel_over_batched_long_doc"] = out["kv_parallel_over_batched_doc4096"]
    return out


# The brief's targets: (finding, comparison, bound, what it means). Reported, never asserted.
TARGETS = [
    ("parallel_speedup_vs_independent_plain", ">=", 10.0, "parallel >= 10x faster than independent (plain ops)"),
    ("parallel_speedup_vs_hf_batched", ">=", 8.0, "parallel >= 8x faster than HF batched generate"),
    ("decode_growth_over_flops_growth", "<=", 1.2, "doc 512 -> 4096: decode time per step grows <= 1.2x FLOPs"),
    ("kv_parallel_over_batched_long_doc", "<=", 1 / 32, "doc 4096, 64 questions: parallel KV bytes <= 1/32 of batched"),
    ("parallel_prefill_frac_of_gemm", ">=", 0.5, "parallel prefill >= 50% of the GEMM rate"),
]


def target_rows(found: dict[str, Any]) -> list[tuple[str, str, str]]:
    rows = []
    for key, op, bound, text in TARGETS:
        v = found.get(key)
        if v is None:
            rows.append((text, "not measured in this preset", "-"))
        else:
            met = v >= bound if op == ">=" else v <= bound
            rows.append((text, _fmt(v, 3), "met" if met else "missed"))
    return rows


def write_outputs(out: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    found = findings(records)
    (out / "results.json").write_text(json.dumps({"meta": meta, "findings": found, "records": records},
                                                 indent=1, default=str) + "\n")
    keys = list(dict.fromkeys(k for r in records for k in r))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(records)
    md = [f"# minillama bench ({meta['preset']})", "", f"commit {meta.get('commit', '?')}; model: {meta['model']}; GEMM "
          f"{meta['gemm_gflops']:.1f} GFLOP/s; threads {meta['threads']}", "", headline_table(records), "",
          "## Targets (measured, not asserted)", "", "| target | measured | |", "|---|---|---|"]
    md += [f"| {t} | {v} | {m} |" for t, v, m in target_rows(found)]
    md += ["", "## Findings", "", "| quantity | value |", "|---|---|"]
    md += [f"| {k} | {_fmt(v, 3)} |" for k, v in found.items()]
    for sweep in ("answer16", "docs", "doclen", "grid", "questions"):
        rows = [r for r in records if r["sweep"] == sweep]
        if rows:
            md += ["", f"## {sweep}", "", "| point | method | wall s | prefill s | decode s | speedup vs indep. plain |"
                   " KV MiB | exact match | identical |", "|---|---|---|---|---|---|---|---|---|"]
            md += [f"| {r['label']} | {r['method']} | {_fmt(r['wall_s'])} | {_fmt(r['prefill_s'])} | "
                   f"{_fmt(r['decode_s'])} | {_fmt(r.get('speedup_vs_independent_plain'), 1)} | "
                   f"{_fmt(r['kv_bytes'] / 2**20, 1)} | {r['accuracy'] * 100:.0f}% | "
                   f"{r['identical_to_independent']}/{r['checked_against_independent']} |" for r in rows]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    return plot(out, records)


def plot(out: Path, records: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    rows = [r for r in records if r["sweep"] == "headline"]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        names = [r["method"] for r in rows]
        ax.barh(names, [r["prefill_s"] for r in rows], color="C0", label="prefill")
        ax.barh(names, [r["decode_s"] for r in rows], left=[r["prefill_s"] for r in rows], color="C1",
                label="decode")
        base = next((r["wall_s"] for r in rows if r["method"] == "independent_plain"), None)
        for i, r in enumerate(rows):
            note = f" {r['wall_s']:.1f} s" + (f"  ({base / r['wall_s']:.1f}x)" if base else "")
            ax.text(r["wall_s"], i, note, va="center", fontsize=8)
        ax.set_xlim(0, 1.25 * max(r["wall_s"] for r in rows))
        ax.set_xlabel("generation time, s" + ("  (speedup vs independent_plain)" if base else ""))
        c = rows[0]
        ax.set_title(f"{c['questions']} questions, doc {c['doc_tokens']} tokens, {c['new_tokens']} new tokens")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
        save(fig, "headline.png")

    def lines(sweep: str, x: str, name: str, xlabel: str, logx: bool = False) -> None:
        rows = [r for r in records if r["sweep"] == sweep]
        if not rows:
            return
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r[x], r["wall_s"], r.get("speedup_vs_independent_plain")) for r in rows if r["method"] == m)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[m], label=m)
            if m != "independent_plain" and all(p[2] for p in pts):
                a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=colors[m], label=m)
        xs = sorted({r[x] for r in rows})
        for a in (a1, a2):
            a.set_xlabel(xlabel)
            if logx:
                a.set_xscale("log", base=2)
            a.set_xticks(xs, [str(v) for v in xs])
            a.minorticks_off()
        a1.set_yscale("log")
        a1.set_ylabel("generation time, s")
        a2.set_ylabel("speedup vs independent (plain)")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        save(fig, name)

    lines("docs", "n_docs", "docs.png", "unique documents")
    lines("doclen", "doc_tokens", "doclen.png", "document tokens", logx=True)
    lines("questions", "questions_per_doc", "questions.png", "questions per document", logx=True)

    par = sorted((r for r in records if r["sweep"] == "doclen" and r["method"] == "parallel"
                  and r["decode_s_per_step"]), key=lambda r: r["doc_tokens"])
    if len(par) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        x = [r["doc_tokens"] for r in par]
        t0, f0 = par[0]["decode_s_per_step"], par[0]["decode_flops_per_step"]
        ax.plot(x, [r["decode_s_per_step"] / t0 for r in par], "o-", label="parallel decode time per step")
        ax.plot(x, [r["decode_flops_per_step"] / f0 for r in par], "k--", label="decode FLOPs per step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.set_xlabel("document tokens")
        ax.set_ylabel(f"relative to doc {x[0]}")
        ax.set_title(f"{par[0]['questions']} questions decoding together")
        ax.legend(fontsize=8)
        save(fig, "decode_step.png")

    grid = [r for r in records if r["sweep"] == "grid"]
    if grid:
        bds = sorted({r["batch_docs"] for r in grid})
        pss = sorted({r["parallel_size"] for r in grid})
        t = [[next((r["wall_s"] for r in grid if r["batch_docs"] == b and r["parallel_size"] == p), float("nan"))
              for p in pss] for b in bds]
        fig, ax = plt.subplots(figsize=(5, 3.6))
        im = ax.imshow(t, cmap="viridis_r")
        ax.set_xticks(range(len(pss)), [str(p) for p in pss])
        ax.set_yticks(range(len(bds)), [str(b) for b in bds])
        ax.set_xlabel("parallel size (questions per document per wave)")
        ax.set_ylabel("batch size (documents per pass)")
        for i in range(len(bds)):
            for j in range(len(pss)):
                ax.text(j, i, f"{t[i][j]:.3g}", ha="center", va="center", color="w")
        fig.colorbar(im, label="generation time, s")
        g0 = grid[0]
        ax.set_title(f"{g0['n_docs']} docs x {g0['questions_per_doc']} questions")
        save(fig, "grid.png")
    return paths


# ------------------------------------------------------------------------------------------------------
# Where the time goes: torch.profiler with minillama's functions marked


# Functions looked up by name at call time in these modules, so wrapping the module attribute marks them.
_MARKED = {"model": ("plan_attention", "blocked_attention", "masked_attention", "linear", "apply_rope"),
           "generate": ("_decode",)}


def profile_breakdown(ctx: Context, task: Task, mode: str = "parallel", invariant: bool = True,
                      idx: list[int] | None = None) -> dict[str, Any]:
    """Run one method under torch.profiler and split its CPU time by phase (prefill / decode), by
    minillama function (attention planning, blocked attention, linear layers, RoPE, the rest) and, inside
    attention, by aten op (gather = index, bmm, elementwise, scatter = index_put/scatter_reduce, ...).

    Self CPU time of each aten op is charged to the innermost marked function around it; ops outside any
    marked function count as "other" (norms, embedding, sampling, glue). Shares, not absolute times, are
    what to read: the profiler adds ~10 us per op.
    """
    import importlib

    from torch.profiler import ProfilerActivity, profile, record_function

    saved: list[tuple[Any, str, Any]] = []

    def mark(mod: Any, name: str) -> None:
        fn = getattr(mod, name)

        def marked(*a: Any, **k: Any) -> Any:
            with record_function(f"ml::{name}"):
                return fn(*a, **k)
        saved.append((mod, name, fn))
        setattr(mod, name, marked)

    for mod_name, names in _MARKED.items():
        mod = importlib.import_module(f"minillama.{mod_name}")
        for name in names:
            mark(mod, name)
    idx = list(range(task.n)) if idx is None else idx
    runner = RUNNERS[{("independent", True): "independent", ("independent", False): "independent_plain",
                      ("parallel", False): "parallel_plain"}.get((mode, invariant), mode)]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            res = runner(ctx, task, idx)
            wall = time.perf_counter() - t0
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)

    by_fn: dict[tuple[str, str], float] = {}
    attn_ops: dict[str, float] = {}
    events = prof.events()
    for ev in events:
        # A marked range's own self time is the Python between its ops (e.g. planning's loops).
        own = ev.name[4:] if ev.name.startswith("ml::") and ev.name != "ml::_decode" else None
        phase, fn, p = "prefill", own or "other", ev
        while p is not None:
            if p.name == "ml::_decode":
                phase = "decode"
            elif p is not ev and p.name.startswith("ml::") and fn == "other":
                fn = p.name[4:]
            p = p.cpu_parent
        t = ev.self_cpu_time_total / 1e6
        by_fn[(phase, fn)] = by_fn.get((phase, fn), 0.0) + t
        if fn in ("blocked_attention", "masked_attention"):
            op = _OP_KIND.get(ev.name, ev.name.removeprefix("aten::"))
            attn_ops[f"{phase}:{op}"] = attn_ops.get(f"{phase}:{op}", 0.0) + t
    total = sum(by_fn.values())
    return {"mode": mode, "invariant": invariant, "questions": len(idx), "wall_s": wall,
            "prefill_s": res.prefill_s, "decode_s": res.decode_s, "profiled_cpu_s": total,
            "by_function": {f"{ph}:{fn}": v for (ph, fn), v in sorted(by_fn.items(), key=lambda x: -x[1])},
            "attention_ops": dict(sorted(attn_ops.items(), key=lambda x: -x[1]))}


_OP_KIND = {"aten::index": "gather (index)", "aten::index_select": "gather (index)", "aten::bmm": "bmm",
            "aten::index_put_": "scatter (index_put)", "aten::_index_put_impl_": "scatter (index_put)",
            "aten::scatter_reduce_": "row max (scatter_reduce)", "aten::exp_": "exp", "aten::exp": "exp",
            "aten::sub_": "sub", "aten::add": "tree merge (add)", "aten::copy_": "copy", "aten::fill_": "fill",
            "aten::zero_": "fill", "aten::amax": "amax", "aten::sum": "sum", "aten::masked_fill_": "mask",
            "aten::where": "where", "aten::div": "div", "aten::cat": "cat", "aten::mul": "mul"}


def profile_table(p: dict[str, Any]) -> str:
    tot = p["profiled_cpu_s"]
    lines = [f"{p['mode']} (invariant={p['invariant']}), {p['questions']} questions: wall {p['wall_s']:.1f} s "
             f"(prefill {p['prefill_s']:.1f} s, decode {p['decode_s']:.1f} s), profiled op time {tot:.1f} s", "",
             "| phase:function | s | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |" for k, v in p["by_function"].items() if v / tot > 0.002]
    lines += ["", "| phase:attention op | s | share of all |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |" for k, v in p["attention_ops"].items() if v / tot > 0.002]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# The command


def random_llama(config: LlamaConfig, seed: int = 0) -> Llama:
    """Random weights (std 0.02, norms 1): the speed of a real model, none of its answers."""
    g = torch.Generator().manual_seed(seed)
    model = Llama(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


SMOLLM2_SHAPE = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                            tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
TINY_SHAPE = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def setup(model_path: str | None, random_shape: LlamaConfig | None, hf: bool, workdir: Path) -> Context:
    """The model, its tokenizer and (with hf) an HF directory holding the same weights."""
    if random_shape is not None:
        model = random_llama(random_shape)
        tok = WordTokenizer(random_shape.vocab_size)
        hf_path = None
        if hf:
            from .weights import save_hf_dir

            hf_path = str(save_hf_dir(random_shape, model.state_dict(), None, workdir / "hf_random"))
        return Context(model, tok, hf_path)
    from .weights import _is_hf_dir, default_model_dir, load_model

    model, tok = load_model(model_path)
    path = Path(model_path) if model_path else default_model_dir()
    hf_path = str(path) if hf and path.is_dir() and _is_hf_dir(path) else None
    if hf and hf_path is None:
        from .weights import save_hf_dir

        hf_path = str(save_hf_dir(model.config, model.state_dict(), None, workdir / "hf_copy"))
    return Context(model, tok, hf_path)


def run(cases: list[Case], ctx: Context, repeats: int, log: Callable[[str], None] = print) -> tuple[list, list]:
    reference: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    gemm: list[float] = []
    records = []
    # Independent first in each case, so that every later method is checked against it.
    for case in cases:
        case.methods = tuple(sorted(case.methods, key=lambda m: m != "independent"))
        records += run_case(ctx, case, repeats, reference, gemm, log)
    return records, gemm


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillama.bench", description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny random model, seconds (CI smoke test)")
    g.add_argument("--full", action="store_true", help="no sampling, 3 repeats (long)")
    ap.add_argument("-m", "--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random", action="store_true", help="random weights with the default model's shape")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers methods")
    ap.add_argument("--only", help="comma-separated sweeps to run (headline,docs,doclen,grid,questions)")
    ap.add_argument("--repeats", type=int, help="repeats per method (medians are reported)")
    ap.add_argument("--sample", type=int, help="questions run by the sampled methods in the headline case")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of benchmarking: profile parallel and independent at the paper's configuration "
                         "(--doc-tokens to change the document) and write profile.md")
    ap.add_argument("--doc-tokens", type=int, default=512, help="document length for --profile")
    ap.add_argument("--out", default="bench_results", help="output directory")
    ap.add_argument("--from-json", metavar="RESULTS", help="rewrite tables and plots from a results.json, run nothing")
    a = ap.parse_args(argv)
    if a.from_json:
        data = json.loads(Path(a.from_json).read_text())
        paths = write_outputs(Path(a.out), data["records"], data["meta"])
        print(headline_table(data["records"]) + "\n")
        print("\n".join(f"{t}: {v} ({m})" for t, v, m in target_rows(findings(data["records"]))))
        print("wrote", ", ".join(str(p) for p in paths))
        return 0

    name = "quick" if a.quick else "full" if a.full else "default"
    # The tiny model's ops last microseconds: a second thread only adds synchronisation (10x slower on a
    # busy 2-core machine). The real model uses every core torch sees.
    threads = a.threads or (1 if a.quick else None)
    if threads:
        torch.set_num_threads(threads)
    hf = not a.no_hf
    if hf:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            print("transformers is not installed: skipping the hf_* methods", file=sys.stderr)
            hf = False
    cases, repeats = preset(name, hf)
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c.sweep in keep]
    if a.repeats:
        repeats = a.repeats
    if a.sample is not None:
        for c in cases:
            if c.sweep == "headline":
                c.sample = a.sample or None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shape = TINY_SHAPE if a.quick else SMOLLM2_SHAPE if a.random else None
    scratch = tempfile.TemporaryDirectory(prefix="minillama-bench-")  # HF copies of random weights
    ctx = setup(a.model, shape, hf, Path(scratch.name))
    model_name = "random " + ("tiny" if a.quick else "SmolLM2-135M shape") if shape else (a.model or "SmolLM2-135M-Instruct")
    if a.profile:
        return _profile_main(ctx, out, a.doc_tokens, 8 if a.quick else 64, model_name)
    print(f"minillama bench, preset {name}: {len(cases)} cases, {repeats} repeats, model {model_name} "
          f"(setup {time.perf_counter() - t0:.1f} s)", flush=True)
    records, gemm = run(cases, ctx, repeats, log=lambda s: print(s, flush=True))
    meta = {"preset": name, "model": model_name, "commit": _commit(), "threads": torch.get_num_threads(), "repeats": repeats,
            "gemm_gflops": statistics.median(gemm), "gemm_gflops_all": gemm, "torch": torch.__version__,
            "run_s": time.perf_counter() - t0, "command": " ".join(["python -m minillama.bench", *(argv or sys.argv[1:])])}
    paths = write_outputs(out, records, meta)
    print()
    print(headline_table(records))
    print()
    if a.quick:
        print("(a tiny random model: the targets are about the default model; these lines only show the harness works)")
    for t, v, m in target_rows(findings(records)):
        print(f"{t}: {v} ({m})")
    print(f"\nwrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.md'}, "
          + ", ".join(str(p) for p in paths) + f" in {time.perf_counter() - t0:.0f} s")
    return 0


def _commit() -> str:
    """The checked-out commit, with "+dirty" when minillama/ (this file aside) has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "minillama",
                                ":!minillama/bench.py"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _profile_main(ctx: Context, out: Path, doc_tokens: int, questions: int, model_name: str) -> int:
    task = make_task(ctx.tokenizer, TaskConfig(doc_tokens=doc_tokens, questions_per_doc=questions, new_tokens=8),
                     plain_prompt_ids(ctx.tokenizer))
    runs = {}
    for mode, inv, idx in (("parallel", True, None), ("parallel", False, None), ("independent", True, [0]),
                           ("independent", False, [0])):
        p = profile_breakdown(ctx, task, mode, inv, idx)
        runs[f"{mode}{'' if inv else '_plain'}"] = p
        print(profile_table(p) + "\n", flush=True)
    (out / "profile.json").write_text(json.dumps(runs, indent=1) + "\n")
    head = f"# Profile: {model_name}, doc {doc_tokens} tokens, {questions} questions, 8 new tokens, " \
           f"{torch.get_num_threads()} threads\n"
    (out / "profile.md").write_text(head + "\n" + "\n\n".join(profile_table(p) for p in runs.values()) + "\n")
    print(f"wrote {out / 'profile.md'}, {out / 'profile.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
