"""Compiled steps (step.py, `model.steps.compiled`): each layer through torch.compile, one graph per bucket.

Compiled arithmetic is not eager arithmetic (Inductor fuses the elementwise ops and reduces in its own
order), so compiled answers are not the bits of uncompiled ones; what must hold is the guarantee itself,
among compiled steps: parallel == independent and prefill == decode, to the bit, captured or not. Every
pass of a compiled model is compiled (its attention items held at once), so no eager pass mixes other bits
into the cache. Compiles are slow on a CPU (tens of seconds for the first shape), so these tests share one
workload, whose shapes each process compiles once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

import minillama.proofs as proofs
import minillama.step as step_module
from minillama.errors import BadInput
from minillama.generate import SamplingParams, generate
from minillama.weights.default import user_cache_dir
from test_parity import TILES, assert_same_answers, workloads
from test_step import Rerun, _captured
from tiny import DEVICE, configs, tiny_config, tiny_model

DOC = [(7 * i) % 50 + 3 for i in range(90)]  # a document of two key blocks and part of a third
PROMPTS = [DOC + [5, 6, 7, 8, 9, 10, 11, 3], DOC + [5, 6, 7, 8, 9, 10, 12, 13, 4], DOC + [5, 6, 7, 8, 9, 10, 14]]


def _params(temperature: float) -> SamplingParams:
    return SamplingParams(max_new_tokens=5, temperature=temperature, seed=3, keep_logits=True, ignore_eos=True)


def _compiled(model):
    model.steps.compiled = True
    return model


def _compiled_calls(monkeypatch) -> list[int]:
    """Counts the calls of compiled layers (compile_block's function), one entry per call."""
    calls: list[int] = []
    compile_block = step_module.compile_block

    def counting():
        run = compile_block()
        return lambda *args: calls.append(1) or run(*args)

    monkeypatch.setattr(step_module, "compile_block", counting)
    return calls


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_compiled_steps_keep_parallel_equal_to_independent(monkeypatch, temperature):
    calls = _compiled_calls(monkeypatch)
    model = _compiled(tiny_model(tiny_config()))
    # Not captured, so every step calls its layers (a replayed graph calls nothing); on a GPU, gpu_check's
    # parity check runs the compiled steps captured.
    model.steps.captured = False
    params = _params(temperature)
    parallel = generate(model, PROMPTS, params, mode="parallel")
    alone = generate(model, PROMPTS, params, mode="independent")
    assert len(calls) >= 2 * 5 * model.config.num_hidden_layers  # every step's layers ran compiled
    assert_same_answers(alone, parallel)
    # The negative control: the same workload with eager steps has other bits, so that a run mixing eager and
    # compiled passes (an eager prefill's cache under compiled decode steps) is caught by the check above.
    model.steps.compiled = False
    eager = generate(model, PROMPTS, params, mode="independent")
    with pytest.raises(AssertionError, match="differ"):
        assert_same_answers(eager, parallel)


# A product or a product-like kernel in Inductor's code for a layer (a comment line names the ATen ops it
# came from, so only code lines are read): cuBLAS/BLAS calls, oneDNN's linear, Triton matmul templates.
PRODUCT_KERNEL = re.compile(r"extern_kernels\.\w*mm\b|aten\.\w*mm\b|mkldnn\.|triton_tem_")
OPAQUE_OPS = ("tiled_linear", "tiled_mean_square", "batched_products", "batched_row_sums")


def _layer_code(model, prompts, params) -> list[str]:
    """Inductor's code for each layer graph of one parallel run, compiled afresh (every cache off)."""
    import torch._dynamo

    torch._dynamo.reset()  # a layer graph of these shapes compiled by an earlier test would be reused unseen
    with torch._inductor.config.patch(force_disable_caches=True):
        _, code = run_and_get_code(generate, model, prompts, params, mode="parallel")
    assert code, "no layer graph was compiled"
    return [line for source in code for line in source.splitlines() if not line.lstrip().startswith("#")]


def test_products_and_reductions_stay_whole_under_compile(monkeypatch):
    """Inductor would fuse a product with its neighbours: a residual added after a tile's `mm` became one
    `addmm`, but only where the pass was exactly one tile, and `addmm` adds in another order. So under
    compile every fixed-signature product and reduction is an opaque op (proofs.opaque) run as it is.
    Checked in Inductor's code on every device: each layer graph calls the four opaque ops and issues no
    product of its own; with `OPAQUE` off (the negative control) it issues them. On a CPU, where the fault was
    found, parity itself breaks with it off: a shape (256 features, 768 hidden, the CPU's tiles) at which the
    fused `addmm` rounds otherwise."""
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 50, (100,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 50, (n,), generator=g).tolist() for n in (6, 11, 17)]
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    model = _compiled(tiny_model(tiny_config(layers=1, heads=4, kv_heads=2, head_dim=64), tiles=None))

    def alone_and_packed():
        return generate(model, prompts, params, mode="independent"), generate(model, prompts, params, mode="parallel")

    code = _layer_code(model, prompts, params)
    assert not [line for line in code if PRODUCT_KERNEL.search(line)]
    assert all(any(f"torch.ops.minillama.{op}." in line for line in code) for op in OPAQUE_OPS)
    assert_same_answers(*alone_and_packed())
    monkeypatch.setattr(proofs, "OPAQUE", False)
    assert [line for line in _layer_code(model, prompts, params) if PRODUCT_KERNEL.search(line)]
    if DEVICE.type == "cpu":
        with pytest.raises(AssertionError, match="differ"):
            assert_same_answers(*alone_and_packed())


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(config=configs(), seed=st.integers(0, 1000), work=workloads(), tiles=TILES,
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_compiled_parallel_equals_independent_property(config, seed, work, tiles, dtype):
    """The parity property (test_parity.py) with compiled steps: the family, dtype, tiles and layouts drawn."""
    prompts, docs, params, eos, layout = work
    model = _compiled(tiny_model(config, seed, dtype, tiles))
    alone = generate(model, prompts, params, mode="independent", eos_ids=eos)
    assert_same_answers(alone, generate(model, prompts, params, mode="parallel", docs=docs, eos_ids=eos, **layout))


def test_compiled_prefill_equals_decode():
    """A token's logits when generated equal its logits in one teacher-forced pass over prompt + answer, both
    compiled: the pass lays its items out in buckets and holds them at once, like every compiled pass."""
    model = _compiled(tiny_model(tiny_config()))
    for prompt, a in zip(PROMPTS, generate(model, PROMPTS, _params(0.0), mode="independent")):
        forced = model(torch.tensor(prompt + a.token_ids[:-1]))[len(prompt) - 1:]
        for step, (x, y) in enumerate(zip(a.logits, forced, strict=True)):
            assert torch.equal(x, y), f"step {step}: logits differ by {(x - y).abs().max()}"


def test_a_compiled_pass_past_its_attention_bound_goes_in_halves_with_the_bits_of_one(monkeypatch):
    """A compiled pass holds every attention item at once; past `AttentionTiles.at_once` bytes (its estimate,
    `Llama.at_once_bytes`) it goes as passes of half its tokens, split again while too big: the wanted logits
    rows, in their order, with the bits of one pass. (The layers run eagerly on the compiled layout here: the
    split is checked, not the compiler, whose prefill == decode is the test above.)"""
    model = _compiled(tiny_model(tiny_config()))
    model.steps._compiled_block = step_module.run_block
    tokens = torch.tensor(PROMPTS[1] * 2)  # 194 tokens: four key blocks
    one = model(tokens)
    passes: list[int] = []
    lay_out = model.lay_out
    monkeypatch.setattr(model, "lay_out", lambda cache, t, *a, **k: passes.append(len(t)) or lay_out(cache, t, *a, **k))
    assert model(tokens).equal(one) and passes == [len(tokens)]  # the default bound: one pass
    tiles = model.tiles
    bound = model.at_once_bytes(torch.arange(len(tokens))) // 5
    model.kernels.tiles = dataclasses.replace(tiles, attention=dataclasses.replace(tiles.attention, at_once=bound))
    passes.clear()
    assert torch.equal(model(tokens), one)
    assert len(passes) >= 5 and sum(passes) == len(tokens)
    starts = [sum(passes[:i]) for i in range(len(passes))]
    assert all(model.at_once_bytes(torch.arange(s, s + n)) <= bound for s, n in zip(starts, passes))
    rows = torch.tensor([len(tokens) - 1, 3, 150, 0])  # a decode step's rows, in any order
    assert torch.equal(model(tokens, logits_rows=rows), one[rows])


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA the parity check above runs real graphs of compiled steps")
def test_captured_compiled_steps_replay_the_compiled_bits():
    """The way a GPU runs a compiled model: compiled steps captured per bucket and replayed (here through the
    CPU stand-in for a graph) give the bits of compiled steps run each time."""
    plain = generate(_compiled(tiny_model(tiny_config())), PROMPTS, _params(0.8), mode="parallel")
    capture = Rerun()
    replayed = generate(_captured(_compiled(tiny_model(tiny_config())), capture), PROMPTS, _params(0.8),
                        mode="parallel")
    assert capture.captures >= 1 and capture.replays > capture.captures
    assert_same_answers(plain, replayed)


def test_a_compiled_model_refuses_a_shape_past_its_limit(monkeypatch):
    """Past `COMPILED_SHAPES` graphs a step raises rather than run its layers eagerly (other bits)."""
    import torch._dynamo

    torch._dynamo.reset()  # the graphs earlier tests compiled (a layer's graph serves any model of its shapes)
    monkeypatch.setattr(step_module, "COMPILED_SHAPES", 1)
    model = _compiled(tiny_model(tiny_config()))
    with pytest.raises(Exception, match="(?i)recompile"):
        generate(model, PROMPTS, _params(0.0), mode="parallel")  # a prefill and a decode shape: two graphs


def test_a_tensor_parallel_rank_refuses_compiled_steps():
    model = _compiled(tiny_model(tiny_config()))
    model.kernels.comm = object()  # what a rank holds in place of NoComm: real collectives
    with pytest.raises(ValueError, match="compiled steps run in one process"):
        model(torch.tensor([5, 6, 7]))


@contextlib.contextmanager
def no_compiler():
    """No working C++ compiler, and nothing compiled to fall back on (every cache off, the in-process ones
    dropped). Inductor's own `config.patch`, which restores an aliased setting as it found it."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with inductor_config.patch({"force_disable_caches": True, "cpp.cxx": (None, "/nonexistent/c++")}):
        yield


@pytest.mark.skipif(DEVICE.type == "cuda", reason="a GPU's layers compile to Triton kernels, not C++")
def test_no_compiler_is_one_line_that_names_the_way_out():
    """Compiled steps where torch.compile has no working compiler: BadInput (the CLI's one line, exit 2) that
    names what is missing and says to run without --compile, at the load's check and at a first step alike."""
    with no_compiler(), pytest.raises(BadInput, match="InvalidCxxCompiler.*without --compile"):
        step_module.check_compiler(DEVICE)
    with no_compiler(), pytest.raises(BadInput, match="InvalidCxxCompiler.*without --compile"):
        generate(_compiled(tiny_model(tiny_config())), PROMPTS[:1], _params(0.0), mode="independent")


def test_compiled_code_goes_to_minillamas_cache_directory(monkeypatch, tmp_path):
    """Unset (or torch's temporary default), compiled code is kept in minillama's cache directory; a
    directory the user chose is kept."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    step_module.keep_compiled_code()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(user_cache_dir() / "inductor")
    assert str(tmp_path) in os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    step_module.keep_compiled_code()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.parametrize("variable", ["XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"])
def test_a_compile_cache_that_cannot_be_made_is_named(monkeypatch, tmp_path, variable):
    """A cache folder under a file: one line naming the folder and the variable it came from, not the model
    (whose load the first compile is part of)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    monkeypatch.setenv(variable, str(tmp_path / "file" / "cache"))
    with pytest.raises(BadInput, match=rf"^--compile: the compile cache {tmp_path}/file/cache\S* \(from \${variable}\) "
                                       r"cannot be made \(Not a directory\); set TORCHINDUCTOR_CACHE_DIR"):
        step_module.keep_compiled_code()


def test_a_second_compile_of_a_shape_is_read_from_disk(monkeypatch, tmp_path):
    """After the in-process caches are dropped (as in a new process), the same shapes compile from the files
    the first compile left in the cache directory: Inductor's graph cache hits, and nothing is compiled
    cold."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    prompts = [DOC[:20] + [5, 6]]
    generate(_compiled(tiny_model(tiny_config())), prompts, _params(0.0), mode="parallel")
    assert any(tmp_path.iterdir())
    torch._dynamo.reset()
    counters.clear()
    generate(_compiled(tiny_model(tiny_config())), prompts, _params(0.0), mode="parallel")
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
