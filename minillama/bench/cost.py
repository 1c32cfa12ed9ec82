"""What the work costs: FLOPs counted from the shapes, and what this machine can do (its GEMM rate)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

from ..config import LlamaConfig
from ..generate import shared_prefix_length
from ..precision import onednn_available, onednn_linear

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


def flop_rates(useful: float, executed: float, wall_s: float, gemm_gflops: float) -> dict[str, float]:
    """A method's FLOP rates from its counted FLOPs and wall time: the useful rate (the cost model's least
    work, `CostModel.parallel`, per second) in GFLOP/s and as a fraction of the GEMM rate measured in the
    same run, and the executed FLOPs' (what the method really computes) fraction of it."""
    if not wall_s or not gemm_gflops:
        nan = float("nan")
        return {"useful_gflops": nan, "useful_frac_of_gemm": nan, "executed_frac_of_gemm": nan}
    return {"useful_gflops": useful / wall_s / 1e9, "useful_frac_of_gemm": useful / wall_s / 1e9 / gemm_gflops,
            "executed_frac_of_gemm": executed / wall_s / 1e9 / gemm_gflops}


def fastest_gemm_s(a: torch.Tensor, b: torch.Tensor, repeats: int = 5,
                   sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of one a @ b, the median of `repeats`, by the faster of torch's two GEMMs: `torch.matmul` and,
    on a CPU in float32 where torch has it, oneDNN's linear (which the linear layers use there,
    precision.cpu_gemm). `sync` waits for the device after each product."""
    products = [lambda: torch.matmul(a, b)]
    if a.device.type == "cpu" and a.dtype == torch.float32 and onednn_available():
        w = b.t().contiguous()  # (n, k): oneDNN's weight layout
        products.append(lambda: onednn_linear(a, w))
    best = float("inf")
    for product in products:
        product()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            product()
            sync()
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


def gemm_rate(m: int = 2048, k: int = 576, n: int = 1536, repeats: int = 5) -> float:
    """fp32 GFLOP/s of one (m, k) @ (k, n) product on this machine (`fastest_gemm_s`). The defaults are
    SmolLM2-135M's MLP (hidden 576, intermediate 1536); the task bench passes its model's."""
    return 2 * m * k * n / fastest_gemm_s(torch.randn(m, k), torch.randn(k, n), repeats) / 1e9
