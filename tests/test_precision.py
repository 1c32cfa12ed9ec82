"""16-bit models on a CPU: native products where the CPU has 16-bit dot products, float32 on 16-bit storage
where it has not (precision.py), the same choice in every layout.

The parity property (tests/test_parity.py) and the signature audit (tests/test_signatures.py) cover both
paths across layouts; here: which arithmetic the products really use, that the float32 path keeps
16-bit storage and is row-invariant across its column slices, and the override's bad values.
"""

import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillama import precision
from minillama.audit import ProductSignatures
from minillama.generate import SamplingParams, generate
from minillama.invariant import linear, tiled_linear
from tiny import tiny_config, tiny_model

CPU = torch.device("cpu")
CONFIG = tiny_config(layers=1, heads=4, kv_heads=2, head_dim=8, tied=True)


def product_dtypes(model) -> set[torch.dtype]:
    """The dtypes of the operands of the linear layers' products (`mm`, or oneDNN's linear) while answering
    two questions."""
    prompts = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 11]]
    with ProductSignatures() as seen:
        out = generate(model, prompts, SamplingParams(max_new_tokens=2), mode="parallel", docs=[0, 0])
    assert all(len(a.token_ids) == 2 for a in out)
    return {t[2] for op, tensors in seen.signatures if op.startswith(("aten.mm", "mkldnn._linear")) for t in tensors}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16bit_model_computes_in_float32_where_this_cpu_has_no_native_dot_products(dtype, monkeypatch):
    monkeypatch.delenv(precision.ENV, raising=False)
    model = tiny_model(CONFIG, 0, dtype).to(CPU)
    native = precision.native_features(dtype)
    assert product_dtypes(model) == ({dtype} if native else {torch.float32}), precision.describe(CPU, dtype)
    assert all(p.dtype == dtype for p in model.parameters())  # storage stays 16-bit either way


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_override_picks_either_path(dtype, monkeypatch):
    """The negative control of the test above: the recorder sees 16-bit products when they are issued."""
    model = tiny_model(CONFIG, 0, dtype).to(CPU)
    monkeypatch.setenv(precision.ENV, "native")
    assert product_dtypes(model) == {dtype}
    assert precision.describe(CPU, dtype).startswith("native")
    monkeypatch.setenv(precision.ENV, "float32")
    assert product_dtypes(model) == {torch.float32}
    assert precision.describe(CPU, dtype).startswith("float32 products")


def test_the_choice_follows_the_cpu_features(monkeypatch):
    monkeypatch.delenv(precision.ENV, raising=False)
    for features, expected in (([], torch.float32), (["avx512_bf16"], torch.bfloat16)):
        monkeypatch.setattr(precision, "native_features", lambda dtype, f=features: f)
        precision._decide.cache_clear()
        assert precision.compute_dtype(CPU, torch.bfloat16) == expected
    precision._decide.cache_clear()
    assert precision.compute_dtype(CPU, torch.float32) == torch.float32  # float32 is never cast
    assert precision.compute_dtype(torch.device("meta"), torch.float16) == torch.float16  # an accelerator: native


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_float32_path_is_row_invariant_across_column_slices(dtype, monkeypatch):
    """A weight wider than one slice (2,500 outputs: three slices of at most 1,024): each row's result is
    the same alone and among 150 others, and it is float32 arithmetic rounded once to 16 bits."""
    monkeypatch.setenv(precision.ENV, "float32")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(150, 96, generator=g).to(dtype)
    w = (torch.randn(2500, 96, generator=g) / 10).to(dtype)
    with torch.no_grad():
        full = tiled_linear(x, w, 16)
        assert full.dtype == dtype and full.shape == (150, 2500)
        for i in (0, 17, 149):
            assert torch.equal(tiled_linear(x[i:i + 1], w, 16), full[i:i + 1])
        ref = (x.float() @ w.float().T).to(dtype)  # within one 16-bit rounding step of it
        assert ((full.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7 + 1e-6).all()
        plain = linear(x, w, invariant=False)  # the plain path computes in float32 too
        assert plain.dtype == dtype and torch.allclose(plain.float(), full.float(), rtol=2 ** -7, atol=1e-3)


def test_a_bad_override_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setenv(precision.ENV, "fast")
    message = "MINILLAMA_CPU_16BIT='fast': expected one of auto, native, float32"
    with pytest.raises(ValueError, match=message):
        precision.compute_dtype(CPU, torch.bfloat16)
    run = subprocess.run([sys.executable, "-m", "minillama.generate", "--doc", "a", "--questions", "b"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert (run.returncode, run.stderr.strip()) == (2, f"error: {message}")


class LiveSlices(TorchDispatchMode):
    """At each product (`mm` or oneDNN's linear), how many float32 casts of slices of the weight `w` (the
    casts of `tiled_linear`'s float32 path) are alive."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.storage, self.slices, self.alive_at_mm = w.untyped_storage().data_ptr(), [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (name == "_to_copy" and out.dtype == torch.float32
                and args[0].untyped_storage().data_ptr() == self.storage):
            self.slices.append(weakref.ref(out))
        elif name in ("mm", "_linear_pointwise"):
            self.alive_at_mm.append(sum(r() is not None for r in self.slices))
        return out


@pytest.mark.parametrize("gemm", ["mm", "onednn"])
def test_the_float32_path_holds_one_weight_slice_at_a_time(monkeypatch, gemm):
    """No float32 copy of a whole weight: a 2,500-column weight is cast in three slices, one alive at a time."""
    if gemm == "onednn" and not precision.onednn_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv(precision.ENV, "float32")
    monkeypatch.setenv(precision.GEMM_ENV, gemm)
    x, w = torch.randn(100, 96).to(torch.bfloat16), torch.randn(2500, 96).to(torch.bfloat16)
    with torch.no_grad(), LiveSlices(w) as seen:
        tiled_linear(x, w, 16)
    assert len(seen.slices) == 3 and len(seen.alive_at_mm) == 3 * 7  # 3 slices x 7 tiles of 16 rows
    assert max(seen.alive_at_mm) == 1


def test_a_bad_gemm_override_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.setenv(precision.GEMM_ENV, "blas")
    message = "MINILLAMA_CPU_GEMM='blas': expected one of auto, onednn, mm"
    with pytest.raises(ValueError, match=message):
        precision.cpu_gemm()
    run = subprocess.run([sys.executable, "-m", "minillama.generate", "--doc", "a", "--questions", "b"],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, precision.GEMM_ENV: "blas"})
    assert (run.returncode, run.stderr.strip()) == (2, f"error: {message}")


@pytest.mark.parametrize("gemm", ["mm", "onednn"])
@pytest.mark.parametrize("n, k, column_major", [(1536, 576, False), (576, 1536, True), (200, 48, False)])
def test_either_cpu_gemm_gives_a_row_the_same_bits_wherever_it_sits_in_its_tile(monkeypatch, gemm, n, k,
                                                                                 column_major):
    """The row-invariance the tiles rely on, for each library `cpu_gemm` may pick: a row alone (padded with
    zero rows) and the same row among 63 others, at every third position, give the same bits."""
    if gemm == "onednn" and not precision.onednn_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setenv(precision.GEMM_ENV, gemm)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    w = w.t().contiguous().t() if column_major else w  # o and down are stored so (Llama.column_major_)
    row = torch.randn(k, generator=g)
    with torch.no_grad():
        alone = tiled_linear(row[None], w, 64)[0]
        for at in range(0, 64, 3):
            x = torch.randn(64, k, generator=g)
            x[at] = row
            assert torch.equal(tiled_linear(x, w, 64)[at], alone), at


def test_a_build_whose_onednn_refuses_the_product_takes_torch_mm(monkeypatch):
    """The choice is made once per process from a small product: a oneDNN that raises (or disagrees with
    `torch.mm`) is not used, and `auto` falls back to `torch.mm` rather than failing every linear layer."""
    def refuses(x, w):
        raise RuntimeError("no oneDNN kernel for this layout")

    monkeypatch.delenv(precision.GEMM_ENV, raising=False)
    monkeypatch.setattr(precision, "onednn_linear", refuses)
    precision.onednn_available.cache_clear()
    try:
        assert precision.cpu_gemm() == "mm"
        x, w = torch.randn(5, 48), torch.randn(30, 48)
        assert torch.allclose(tiled_linear(x, w, 64), x @ w.t(), atol=1e-5)
        monkeypatch.setattr(precision, "onednn_linear", lambda x, w: (x @ w.t()) + 1.0)  # wrong answers
        precision.onednn_available.cache_clear()
        assert precision.cpu_gemm() == "mm"
    finally:
        monkeypatch.undo()
        precision.onednn_available.cache_clear()
    assert precision.cpu_gemm() == ("onednn" if precision.onednn_available() else "mm")
