"""How much parallel mode holds at once, and the memory budget it and the server's KV cache keep to
(`--max-memory`): the waves of questions and documents that fit (`wave_plan`), and the budget unset on each
device (`memory_budget`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .errors import BadInput

DEFAULT_MAX_MEMORY_MB = 1024


@dataclass
class WavePlan:
    parallel_size: int | None  # questions of one document decoded together (None: all)
    batch_docs: int | None  # documents per forward pass (None: all)
    bytes: int  # the estimated peak of one pass over those questions and documents


def wave_plan(config: Any, dtype_bytes: int, doc_tokens: Sequence[int], question_tokens: Sequence[Sequence[int]],
              max_new_tokens: int, budget_bytes: int, parallel_size: int | None = None,
              batch_docs: int | None = None, attention_bytes: int = 0) -> WavePlan:
    """The largest waves whose estimated memory fits `budget_bytes` (0: no bound), for the options the
    user left open. What a pass holds: each document's KV once, and per question its own tokens' KV
    (prompt suffix and answer) and a few rows of activations (its logits row over the vocabulary, the
    MLP's hidden rows). The KV cache grows by doubling, so its part is counted twice. `attention_bytes`:
    what attention may hold in a pass whatever the waves (a compiled model's `AttentionTiles.at_once`),
    set aside from the budget first."""
    max_new_tokens = min(max_new_tokens, config.context)  # no answer runs past the context
    kv_per_token = config.kv_bytes_per_token(dtype_bytes)
    per_row = 4 * (2 * config.vocab_size + 3 * config.intermediate_size + 4 * config.hidden_size)
    per_question = [2 * kv_per_token * (max(q, default=0) + max_new_tokens) + per_row for q in question_tokens]
    per_doc = [2 * kv_per_token * d for d in doc_tokens]
    counts = [len(q) for q in question_tokens]
    if budget_bytes and parallel_size is None:
        room = budget_bytes - attention_bytes - max(per_doc)
        p = max(1, room // max(per_question)) if room > 0 else 1
        parallel_size = p if p < max(counts) else None
    p_eff = parallel_size or max(counts)
    one_doc = [d + min(n, p_eff) * q for d, n, q in zip(per_doc, counts, per_question)]
    if budget_bytes and batch_docs is None:
        b = max(1, (budget_bytes - attention_bytes) // max(one_doc))
        batch_docs = b if b < len(one_doc) else None
    b_eff = batch_docs or len(one_doc)
    return WavePlan(parallel_size, batch_docs, attention_bytes + sum(sorted(one_doc, reverse=True)[:b_eff]))


MAX_MEMORY_MB = 2**30  # a pebibyte: past any machine (1e308 MiB overflowed the count in bytes)


def check_max_memory(mb: float | None) -> None:
    if mb is not None and not 0 <= mb <= MAX_MEMORY_MB:
        raise BadInput(f"--max-memory must be a number of MiB from 0 to {MAX_MEMORY_MB:,} (0: no bound), got {mb}")


def memory_budget(max_memory_mb: float | None, llama: Any) -> int:
    """`--max-memory` in bytes (0: no bound). Unset: DEFAULT_MAX_MEMORY_MB on a CPU; on a GPU half its memory
    less the whole model's weights (the rest for activations a budget does not count, the allocator's blocks
    and other work), where 1 GiB would hold 8,192 tokens of an 8B model's keys and values. From the device's
    size and the config, not what is free now nor a rank's own part, so every rank of a run plans alike."""
    if max_memory_mb is not None:
        return math.ceil(max_memory_mb * 2**20)
    if llama.device.type == "cuda":
        import torch

        from .weights.layout import expected_shapes

        weight = next(llama.parameters()).element_size()  # the whole model's, as every rank counts it
        weights = sum(math.prod(shape) for shape in expected_shapes(llama.config).values()) * weight
        return max(torch.cuda.get_device_properties(llama.device).total_memory - weights, 0) // 2
    return DEFAULT_MAX_MEMORY_MB * 2**20


def available_memory() -> int | None:
    """Bytes of memory a process may still take on this machine: Linux's MemAvailable and free swap, within
    the limit of the process's cgroup (v2) where it has one; None where unknown (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if v.strip()}
        free = fields["MemAvailable"] + fields.get("SwapFree", 0)
    except (OSError, ValueError, IndexError, KeyError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(free, 0)
