"""Elementwise ops whose every element a CPU computes with the same code at any thread count (silu).

Torch's CPU kernel for silu computes runs of whole vectors with vector code and finishes a shorter run with
scalar code, whose result differs in the last bit for ~4% of float32 inputs (exp, log, rsqrt and the model's
other elementwise ops give the same bits either way: their tails run the vector code too). A tensor of whole
vectors (the model pads a pass so that its elementwise tensors are: `Tiles.unit`) has no short run, unless
the threads' shares cut one. ATen's `parallel_for` (its OpenMP backend, torch's CPU wheels') cuts n elements
into

    shares = min(threads, ceil(n / GRAIN))  shares of  ceil(n / shares)  elements each.

With 1, 2 or 4 shares of a tensor of whole 128-element vectors every share is whole vectors; with 3, 5, 6 or 7
(three threads and up) a share can end inside a vector, and which elements of a row fall into the scalar run
then depends on how many rows the pass holds: at 6 and 8 threads a question's MLP in a packed pass of 92 rows
gave other bits than in its own pass (threads past a machine's cores cut the work as a bigger machine does).

`in_whole_vectors` runs such an op as one call where its shares are whole vectors already (1 and 2 threads
always, with the model's padding), and otherwise in at most three calls whose shares all are: a multiple of
threads x GRAIN elements (shares of whole GRAINs), then whole GRAINs (one share each, fewer shares than
threads), then the rest (under one GRAIN: one share). Every element is then computed by the vector code.
A GPU's kernels compute every element alike, and compiled code is Inductor's own: both take one call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GRAIN = 32768  # at::internal::GRAIN_SIZE: ATen's parallel_for gives a share at least this many elements
VECTOR = 64  # elements: a multiple of every CPU vector loop's step (two AVX-512 registers of 16-bit values)


def shares(n: int, threads: int) -> list[tuple[int, int]]:
    """[start, stop) of each thread's share of n elements in ATen's parallel_for (one share at <= GRAIN)."""
    if threads <= 1 or n <= GRAIN:
        return [(0, n)]
    count = min(threads, -(-n // GRAIN))
    size = -(-n // count)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def calls(n: int, threads: int) -> list[tuple[int, int]]:
    """[start, stop) of the calls that give n elements only shares of whole vectors: one call where its own
    shares are, else a multiple of threads x GRAIN, whole GRAINs, and the rest (each part present or not)."""
    if all((b - a) % VECTOR == 0 or b == n for a, b in shares(n, threads)):
        return [(0, n)]
    big = n // (threads * GRAIN) * threads * GRAIN
    grains = big + (n - big) // GRAIN * GRAIN
    return [(a, b) for a, b in ((0, big), (big, grains), (grains, n)) if b > a]


def in_whole_vectors(op: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """op(x) for an elementwise op that also takes `out=` (`torch._C._nn.silu`, F.silu's): on a CPU in `calls`,
    so that no thread's share of x ends inside a vector. One call on other devices, for a non-contiguous x, and
    where autograd records it."""
    single = (torch.compiler.is_compiling() or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad)
              or not x.is_contiguous())
    parts = [(0, x.numel())] if single else calls(x.numel(), torch.get_num_threads())
    if len(parts) == 1:
        return op(x)
    out = torch.empty_like(x)
    flat, into = x.view(-1), out.view(-1)
    for a, b in parts:
        op(flat[a:b], out=into[a:b])
    return out
