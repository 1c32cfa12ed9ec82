"""The arithmetic of a 16-bit model's linear products on a CPU: native 16-bit, or float32 on 16-bit storage.

A CPU without native 16-bit dot products has no fast 16-bit matrix product: its 16-bit `mm` runs many times
slower than float32 (docs/precision.md has the measurements). There, a 16-bit model keeps its weights
and activations in 16 bits (the memory saving) and computes each fixed tile's product in float32:
`invariant.tiled_linear` casts the tile's rows and a fixed slice of the weight's columns
(`FLOAT32_COLUMNS`) to float32, multiplies, and rounds the result back to the model's dtype.

The choice is a property of the device and the dtype, never of the pass, so every mode and layout meets
the same products and parity holds either way (tests/test_parity.py runs float32, bfloat16 and float16;
tests/test_signatures.py checks the products). It is made from the CPU's feature flags, not from a timing
probe: a probe on a loaded machine could choose differently in two processes (two tensor-parallel ranks,
or the two runs of a comparison) and move the bits. Native 16-bit is used where the flags show it:

    bfloat16: AVX512-BF16 or AMX        float16: AVX512-FP16 or AMX-FP16

`MINILLAMA_CPU_16BIT=native|float32` overrides the flags (`auto`, the default, reads them). Attention
already computes in float32 for 16-bit models (attention.py), on every device. A GPU always runs native.

Which library computes a CPU's float32 tile products (`cpu_gemm`): oneDNN's linear where torch was built
with it, else `torch.mm` (MKL or OpenBLAS). Both are fixed-signature products, row-invariant at a fixed tile;
they give different bits from each other, so the choice is read from the build, never timed, and both runs
of a comparison make the same one. oneDNN picks its kernels by instruction set (AVX-512 where the CPU has
it) and multiplies a 64-row tile 2-2.6x faster than `torch.mm` on this project's AMD EPYC CPU
(docs/bench/README.md). `MINILLAMA_CPU_GEMM=onednn|mm` overrides it (`auto`, the default, reads the build).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

ENV = "MINILLAMA_CPU_16BIT"
CHOICES = ("auto", "native", "float32")
# Weight columns cast to float32 at a time: the float32 copy of one slice (1024 x K, 2.4 MB at K = 576)
# stays in cache while every row tile meets it, and a 128k-vocabulary LM head never exists whole in float32.
FLOAT32_COLUMNS = 1024
HALF = (torch.bfloat16, torch.float16)

# The dtypes a model runs in, by name: the API's `load`, the tools' --dtype.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_features(dtype: torch.dtype) -> list[str]:
    """The features of this CPU that multiply `dtype` natively (none: no native dot products)."""
    if not torch.backends.mkldnn.is_available():  # torch's 16-bit CPU products run through oneDNN
        return []
    flags = _cpu_flags()
    if dtype == torch.bfloat16:
        found = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_bf16": torch.cpu._is_amx_tile_supported()}
    elif dtype == torch.float16:
        found = {"avx512_fp16": "avx512_fp16" in flags, "amx_fp16": torch.cpu._is_amx_fp16_supported()}
    else:
        return []
    return [name for name, has in found.items() if has]


def cpu_mode() -> str:
    """The override in effect: auto, native or float32."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(CHOICES)}")
    return mode


def compiler_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.assume_constant_result(fn)`: torch.compile takes fn's result as a constant rather than
    trace it. That call imports torch._dynamo, ~1 s of every start, which a process that does not compile
    never needs, so the mark it sets is set here; tests/test_step.py checks it is the same mark."""
    fn._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets
    return fn


@functools.lru_cache(maxsize=None)
def _decide(dtype: torch.dtype, mode: str) -> torch.dtype:
    if mode == "native" or (mode == "auto" and native_features(dtype)):
        return dtype
    return torch.float32


@compiler_constant  # decided once per process: a constant to torch.compile
def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a linear product of `dtype` operands is computed in on `device` (decided once per dtype)."""
    if device.type != "cpu" or dtype not in HALF:
        return dtype
    return _decide(dtype, cpu_mode())


def describe(device: torch.device | str, dtype: torch.dtype) -> str:
    """One line for a report: which path this device and dtype take, and why."""
    device = torch.device(device)
    if device.type != "cpu" or dtype not in HALF:
        return "native"
    name = str(dtype).removeprefix("torch.")
    mode, features = cpu_mode(), native_features(dtype)
    if compute_dtype(device, dtype) == dtype:
        return f"native {name} ({', '.join(features) if mode == 'auto' else ENV + '=native'})"
    why = f"{ENV}=float32" if mode == "float32" else f"no native {name} dot products on this CPU"
    return f"float32 products on {name} storage ({why})"


def why_not_finite(dtype: torch.dtype) -> str:
    """Why a model's logits may hold NaN or inf, for a message: broken weights, or in float16 (largest value
    65504) activations past its range, which bfloat16 and float32 hold (a weight past it is refused on loading)."""
    broken = "the checkpoint's weights hold NaN or inf"
    if dtype == torch.float16:
        return f"the activations passed float16's largest value, 65504 (bfloat16 and float32 hold them), or {broken}"
    return broken


GEMM_ENV = "MINILLAMA_CPU_GEMM"
GEMM_CHOICES = ("auto", "onednn", "mm")


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """Whether this torch runs oneDNN's linear on a CPU: built with it, and a small product works and agrees
    with `torch.mm` (a build whose oneDNN lacks the op, or refuses a dense weight, takes `torch.mm`)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    x, w = torch.linspace(-1, 1, 64 * 96).view(64, 96), torch.linspace(1, -1, 40 * 96).view(40, 96)
    try:
        return bool(torch.allclose(onednn_linear(x, w), x @ w.t(), rtol=1e-4, atol=1e-4))
    except RuntimeError:
        return False


def cpu_gemm() -> str:
    """The library a CPU's float32 tile products use: 'onednn' or 'mm' (torch.mm)."""
    mode = os.environ.get(GEMM_ENV, "auto").strip().lower() or "auto"
    if mode not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={os.environ[GEMM_ENV]!r}: expected one of {', '.join(GEMM_CHOICES)}")
    if mode == "onednn" and not onednn_available():
        raise ValueError(f"{GEMM_ENV}=onednn: this torch has no working oneDNN linear (use mm or auto)")
    return ("onednn" if onednn_available() else "mm") if mode == "auto" else mode


@compiler_constant
def uses_onednn(device: torch.device, calc: torch.dtype) -> bool:
    """Whether products computing in `calc` on `device` run in oneDNN's linear (a CPU in float32 that picks
    it, `cpu_gemm`), outside `torch.compile`, which cannot lower it (it takes `torch.mm`); the tiled and the
    plain products ask the same question."""
    return (device.type == "cpu" and calc == torch.float32 and cpu_gemm() == "onednn"
            and not torch.compiler.is_compiling())


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T in one oneDNN linear: (T, N)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One product for the whole pass, in the arithmetic and library `invariant.tiled_linear` uses on this
    device and dtype: plain and invariant runs then differ by the tiling alone, which is what a
    comparison of the two is meant to measure."""
    calc = compute_dtype(x.device, x.dtype)
    if calc == x.dtype:
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if not grad and uses_onednn(x.device, calc):
            return onednn_linear(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight)
    xc = x.to(calc)
    return torch.cat([F.linear(xc, weight[a:a + FLOAT32_COLUMNS].to(calc))  # (..., <= C) each
                      for a in range(0, weight.shape[0], FLOAT32_COLUMNS)], dim=-1).to(x.dtype)
