"""Watch what a forward pass asks of the backend: the signature of every matrix product, and the launches.

Two `TorchDispatchMode`s that see each aten op as the backend receives it, on any device (a CPU run tells
what a GPU run would be asked for):

- `ProductSignatures` records every matrix product's signature: op, and for each tensor argument its shape,
  strides, dtype and alignment (and, apart, every order-dependent reduction's, `REDUCTIONS`). The library that runs a product (MKL, oneDNN, cuBLAS) chooses its kernel from
  exactly these, so a product issued with the same signature in every layout meets the same arithmetic.
  Bit-parity on every device rests on this set being fixed: tests/test_signatures.py checks it.
- `Launches` counts the ops that launch work (views and bare allocations excluded): on a GPU each is a
  kernel launch, so this is the count that bounds a small pass's speed there.
- `HostReads` records every op that makes the host wait for a value on the device (`.item()`, `.tolist()`,
  a Python branch on a tensor, a data-dependent shape such as `nonzero`, a copy to the host). Run on the
  `meta` device (shapes, no values), each of them also fails: `host_reads` runs a function that way and
  lists what it asked for. A step that lists nothing can be captured and replayed on a GPU (step.py).

    with ProductSignatures() as seen:
        model(tokens, positions, segments, cache)
    seen.signatures  # {("aten.mm.out", (((64, 576), (576, 1), torch.float32, 0), ...)), ...}
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .errors import first_line

# Every aten op that multiplies matrices (the decomposed forms of matmul, linear and einsum end here).
PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
            "_scaled_dot_product_attention_math", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
            "convolution", "_int_mm", "_weight_int4pack_mm", "_scaled_mm",
            "_linear_pointwise", "mkldnn_linear"}  # oneDNN's linear (precision.cpu_gemm)
# Every aten op whose result depends on the order in which it adds (or multiplies) along a dimension. A
# backend chooses that order per shape (a GPU's reduction spreads a row over more threads when there are
# fewer rows), so these too must be issued with fixed signatures. Maxima, minima and arg-maxima are exact
# in any order and are not here. The softmax family is not here either: torch's kernels compute each row
# alone (one thread block or warp per row on CUDA, one thread per row on a CPU), in an order that depends
# on the row's length only.
REDUCTIONS = {"sum", "mean", "nansum", "nanmean", "prod", "var", "std", "var_mean", "std_mean", "norm",
              "linalg_vector_norm", "logsumexp", "cumsum", "cumprod", "trace"}
# Ops that launch nothing: they make a tensor header, or memory that nobody has written yet.
NO_WORK = {"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "lift_fresh", "detach"}


def _describe(t: torch.Tensor) -> tuple:
    """(shape, strides, dtype, offset modulo 16 bytes): what a BLAS looks at to pick a kernel."""
    return tuple(t.shape), tuple(t.stride()), t.dtype, (t.storage_offset() * t.element_size()) % 16


class ProductSignatures(TorchDispatchMode):
    """Records the signature of every matrix product run inside it; `signatures` is the set.

    `reductions` is the same for every order-dependent reduction (`REDUCTIONS`), whose signature also holds
    its other arguments (the dimensions reduced, keepdim).
    """

    def __init__(self):
        super().__init__()
        self.signatures: set[tuple] = set()
        self.reductions: set[tuple] = set()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in PRODUCTS or name in REDUCTIONS:
            flat = tree_flatten((args, kwargs))[0]
            tensors = tuple(_describe(a) for a in flat if isinstance(a, torch.Tensor))
            if name in PRODUCTS:
                self.signatures.add((str(func), tensors))
                self.calls += 1
            else:
                others = tuple(repr(a) for a in flat if not isinstance(a, torch.Tensor))
                self.reductions.add((str(func), tensors, others))
        return func(*args, **kwargs)


# Ops whose result the host must wait for, or whose output shape follows the values of their input.
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "nonzero", "argwhere", "masked_select",
              "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "bincount", "repeat_interleave",
              "masked_scatter", "_assert_async"}


class HostReads(TorchDispatchMode):
    """Records, in `found`, every op that reads a device value back to the host (`HOST_READS`, and copies to
    another device)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.found.append(str(func))
        elif name in ("_to_copy", "copy_"):
            devices = {a.device for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
            if "device" in kwargs and kwargs["device"] is not None:
                devices.add(torch.device(kwargs["device"]))
            if len(devices) > 1:
                self.found.append(f"{func} to {sorted(str(d) for d in devices)}")
        return func(*args, **kwargs)


def host_reads(run) -> list[str]:
    """What `run()` (a function over `meta` tensors) reads back to the host: the ops `HostReads` saw, and the
    error a value read raises on `meta`. [] when it reads nothing."""
    with HostReads() as seen:
        try:
            run()
        except (RuntimeError, NotImplementedError) as error:  # meta has no values to read
            seen.found.append(f"{type(error).__name__}: {first_line(error)}")
    return seen.found


class Launches(TorchDispatchMode):
    """Counts the aten ops that launch work, by name (`counts`) and in all (`total`)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        makes_tensor = any(isinstance(o, torch.Tensor) for o in tree_flatten(out)[0])
        if not func.is_view and name not in NO_WORK and (makes_tensor or name == "_local_scalar_dense"):
            self.counts[str(func)] += 1  # (_local_scalar_dense: .item(), a wait for the device)
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())
