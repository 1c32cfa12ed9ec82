"""Every matrix product has a signature fixed by the config and the tiles, whatever the layout of the pass.

Same signature in, same kernel out: this is what makes the bits of a question's answer independent of the
pass it shares, on any BLAS and any GPU. The audit records every product (op, shapes, strides, dtype,
alignment) while answering many layouts, parallel and independent, and checks that they all come from one
set: the set written out below from the config and the tiles alone. A layout that brought a new signature
would be a place where some backend may pick another kernel and move the bits. Order-dependent reductions
(RMSNorm's mean, the softmax's sums) are held to the same rule: a GPU's reduction kernel, like a BLAS, picks
its split of a row from the shape (on an H100 a row's sum took other bits for 8 rows than for 1).

Also here: the launches a pass issues per layer (each work-launching aten op is a kernel launch on a GPU).
"""

import functools
import os
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillama import batched
from minillama.batched import WIDTH
from minillama.audit import Launches, ProductSignatures
from minillama.config import LlamaConfig
from minillama.generate import SamplingParams, generate
from minillama.invariant import CPU_TILES, CUDA_TILES, Tiles
from minillama.model import Llama, RMSNorm
from minillama.precision import ENV, FLOAT32_COLUMNS, GEMM_ENV, compute_dtype, cpu_gemm, onednn_available
from tiny import ON_CPU, SMALL_TILES, VOCAB, ids, tiny_config, tiny_model


def expected_signatures(model: Llama, tiles: Tiles) -> set[tuple]:
    """The products a model may issue (one `mm` shape per weight and tile row count, whole, short or long; four `bmm`
    shapes for attention) and its order-dependent reductions (a mean per norm width, a sum per attention tile
    kind)."""
    c = model.config
    dt = model.dtype
    acc = torch.promote_types(dt, torch.float32)
    d = c.head_dim
    out = set()
    calc = compute_dtype(model.device, dt)  # a 16-bit model without native dot products: float32 (precision.py)
    onednn = model.device.type == "cpu" and calc == torch.float32 and cpu_gemm() == "onednn"
    for name, mod in model.named_modules():  # a product per tile row count (the whole, short and long tiles)
        for t in (tiles.rows, *tiles.short, *tiles.long) if isinstance(mod, torch.nn.Linear) else ():
            n, k = mod.weight.shape
            w = mod.weight.t()
            step = FLOAT32_COLUMNS if calc != dt else max(n, 1)
            tail = max(2 * WIDTH - ((n - 1) % step + 1), 0)  # the output's columns past N: a narrow last part's
            for a in range(0, n, step):  # one product per slice
                if onednn:  # oneDNN's linear takes the weight as (N, K)
                    p = mod.weight[a:a + FLOAT32_COLUMNS if calc != dt else n].to(calc)
                    out.add(("mkldnn._linear_pointwise.default", (((t, k), (k, 1), calc, 0),
                                                                  (tuple(p.shape), p.stride(), calc, 0))))
                    continue
                p = w[:, a:a + FLOAT32_COLUMNS].to(calc) if calc != dt else w
                pad = max(2 * WIDTH - p.shape[1], 0)  # a narrow part: padded to 2 * WIDTH columns
                p = torch.nn.functional.pad(p, (0, pad)) if pad else p
                out.add(("aten.mm.out", (((t, k), (k, 1), calc, 0), (tuple(p.shape), p.stride(), calc, 0),
                                         ((t, p.shape[1]), (n + tail, 1), calc, 0))))
    t = tiles.rows
    for name, mod in model.named_modules():  # RMSNorm's mean of squares, one (t, K) reduction per tile
        if isinstance(mod, RMSNorm):
            k = mod.weight.shape[0]
            out.add(("aten.mean.out", (((t, k), (k, 1), acc, 0), ((t, 1), (1, 1), acc, 0)), ("-1", "True")))
    for kind in (tiles.attention.whole, tiles.attention.partial):  # a call per item tile and batch count
        for rows in (kind.rows, *kind.short_rows, *kind.long_rows):
            for batch in (kind.batch, *kind.short):
                out |= attention_signatures(rows, batch, d, acc, tiles.attention.fused)
    return out


def attention_signatures(rows: int, batch: int, d: int, acc: torch.dtype, fused: bool) -> set[tuple]:
    """The calls of one kind's items of `rows` rows in calls of `batch` items, head size d, key blocks of 64."""
    b, w = 64, -(-d // WIDTH) * WIDTH  # the values product's columns: d padded (batched.WIDTH)
    out = {("aten.sum.IntList_out", (((batch, rows, b), (rows * b, b, 1), acc, 0),  # the softmax's sums
                                     ((batch, rows, 1), (rows, 1, 1), acc, 0)), ("-1", "True")),
           ("aten.bmm.out", (((batch, rows, d), (rows * d, d, 1), acc, 0),  # scores = q k^T
                             ((batch, d, b), (b * d, 1, d), acc, 0),
                             ((batch, rows, b), (rows * b, b, 1), acc, 0))),
           ("aten.bmm.out", (((batch, rows, b), (rows * b, b, 1), acc, 0),  # values = p v
                             ((batch, b, w), (b * w, w, 1), acc, 0),
                             ((batch, rows, w), (rows * w, w, 1), acc, 0)))}
    if fused:  # q, k, v as (batch, 1, n, D), and the masked items' additive mask
        item = (((batch, 1, rows, d), (rows * d, rows * d, d, 1), acc, 0),
                ((batch, 1, b, d), (b * d, b * d, d, 1), acc, 0), ((batch, 1, b, d), (b * d, b * d, d, 1), acc, 0))
        mask = ((batch, 1, rows, b), (rows * b, rows * b, b, 1), acc, 0)
        out.add(("aten._scaled_dot_product_flash_attention_for_cpu.default", item))
        out.add(("aten._scaled_dot_product_flash_attention_for_cpu.default", (*item, mask)))
    return out


def run_calls(signatures: set[tuple], tiles: Tiles, d: int) -> set[tuple]:
    """The calls of attention's runs among `signatures` (blocks.ItemTiles.runs): n >= `runs` items of a kind
    that meet one key block, their n * T rows as one oneDNN product against the (B, D) key block (scores) and
    one against the (D, B) value block (values), and one sum of the (n, T, B) weights. n follows the pass: each
    run's length is proven once per process (batched.proven_run), as a long linear product's is."""
    b = 64
    out = set()
    for kind in (tiles.attention.whole, tiles.attention.partial):
        for t in (kind.rows, *kind.short_rows) if kind.runs else ():
            for sig in signatures:
                op, args = sig[0], sig[1]
                if op == "mkldnn._linear_pointwise.default":
                    (x_shape, _, _, _), (w_shape, w_stride, _, _) = args
                    k = x_shape[1]
                    w = -(-d // WIDTH) * WIDTH  # values' columns, padded (batched.WIDTH)
                    block = (b, d) if k == d else (w, b)  # keys' (B, D) or values' (D, B)
                    if (x_shape[0] % t == 0 and x_shape[0] // t >= kind.runs and w_shape == block
                            and k in (d, b) and w_stride == (k, 1)):
                        out.add(sig)
                elif op == "aten.sum.dim_IntList" and args[0][0][1:] == (t, b) and args[0][0][0] >= kind.runs:
                    out.add(sig)
    return out


def scan_calls(signatures: set[tuple]) -> set[tuple]:
    """The calls of attention's row-order scans among `signatures`: one `cumsum` over a pass's (rows, J, D + 1)
    terms, issued only where this process proved that it gives the J additions' bits for that J and D
    (batched.proven_scan: a GPU's, never a CPU's). Its rows follow the pass, as a run's length does."""
    proven = {(key.shape[1:], key.dtype) for key, ok in batched._PROVEN.items() if key.kind == "scan" and ok}
    return {sig for sig in signatures if sig[0] == "aten.cumsum.default" and (sig[1][0][0][1:], sig[1][0][2]) in proven}


def test_only_a_proven_scan_is_taken_apart(monkeypatch):
    """A GPU's scans (its run of the CUDA tests at f9e71c4 saw them) are set aside only for a (J, D + 1) and
    dtype this process proved: an unproven `cumsum`, or one of another dtype, stays and fails the check."""
    scan = functools.partial(batched.ItemProof, "scan", None, dtype=torch.float32, device="cpu", threads=0)
    monkeypatch.setattr(batched, "_PROVEN", {scan((98, 9, 65)): (1,), scan((98, 5, 65)): ()})

    def cumsum(shape, dtype):
        return ("aten.cumsum.default", ((shape, (shape[1] * shape[2], shape[2], 1), dtype, 0),), ("1",))

    seen = {cumsum((300, 9, 65), torch.float32), cumsum((300, 5, 65), torch.float32),
            cumsum((300, 9, 65), torch.bfloat16)}
    assert scan_calls(seen) == {cumsum((300, 9, 65), torch.float32)}


@st.composite
def layouts(draw):
    """Documents of 0 to 200 tokens, 1 to 12 questions, answers of 1 to 5 tokens, chunked prefill, waves."""
    prompts, docs = [], []
    for d in range(draw(st.integers(1, 2))):
        doc = ids(draw, 0, 200)
        for _ in range(draw(st.integers(1, 6))):
            prompts.append(doc + ids(draw, 1, 40))
            docs.append(d)
    params = SamplingParams(max_new_tokens=draw(st.integers(1, 5)), ignore_eos=True)
    layout = dict(prefill_chunk=draw(st.sampled_from([16, 100, 512])), parallel_size=draw(st.sampled_from([None, 2])))
    return prompts, docs, params, layout


def answer(model, prompts, docs, params, layout) -> set[tuple]:
    onednn_available()  # its once-per-process check runs a small product: not one of the model's
    model.steps.forget()  # a GPU's captured steps: captured anew under the audit, not replayed unseen
    with ProductSignatures() as seen:
        generate(model, prompts, params, mode="independent")
        generate(model, prompts, params, mode="parallel", docs=docs, **layout)
    assert seen.calls > 0 and seen.reductions
    return seen.signatures | seen.reductions


CONFIG = tiny_config(layers=2, heads=6, kv_heads=2, head_dim=8, tied=True)
# The family's switches bring no product of their own: a window (blocks cut on the left, blocks skipped)
# reuses the masked tiles, biases and q/k norms are elementwise and row-wise.
WINDOWED = tiny_config(layers=2, heads=6, kv_heads=2, head_dim=8, tied=True, model_type="mistral", window=70)
QWEN = tiny_config(layers=2, heads=6, kv_heads=2, head_dim=8, model_type="qwen3", attention_bias=True, rope="yarn")
# A 16-bit model's products: native or float32 on 16-bit storage, whichever this CPU takes (precision.py);
# the other path is checked too, forced by the override.
WIDE = tiny_config(layers=1, heads=6, kv_heads=2, head_dim=8, tied=True, vocab=1500)  # an LM head of two slices
# o and down 6 columns wide, the LM head's last float32 slice too: narrow parts, padded where torch.mm runs them
NARROW = tiny_config(layers=1, heads=1, kv_heads=1, head_dim=6, vocab=1030)
MODELS = {"default tiles": tiny_model(CONFIG, 0, tiles=None), "small tiles": tiny_model(CONFIG, 0),
          "narrow": tiny_model(NARROW, 0), "narrow, bfloat16": tiny_model(NARROW, 0, torch.bfloat16),
          "window, default tiles": tiny_model(WINDOWED, 0, tiles=None), "window, small tiles": tiny_model(WINDOWED, 0),
          "qwen3 with biases": tiny_model(QWEN, 0), "bfloat16": tiny_model(CONFIG, 0, torch.bfloat16),
          "float16, wide vocabulary": tiny_model(WIDE, 0, torch.float16, tiles=None),
          **{f"fused, {dtype}": tiny_model(CONFIG, 0, dtype, tiles=tiles)
             for tiles in ON_CPU for dtype in (torch.float32, torch.bfloat16)}}
PATHS = ["auto", "auto", "auto", "native", "float32"]  # MINILLAMA_CPU_16BIT


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(work=layouts(), which=st.sampled_from(sorted(MODELS)), path=st.sampled_from(PATHS),
       gemm=st.sampled_from(["auto", "mm"]))
def test_every_product_has_a_signature_fixed_by_config_and_tiles(work, which, path, gemm):
    model = MODELS[which]
    with mock.patch.dict(os.environ, {ENV: path, GEMM_ENV: gemm}):
        seen = answer(model, *work)
        expected = expected_signatures(model, model.tiles)
    seen -= run_calls(seen, model.tiles, model.config.head_dim) | scan_calls(seen)
    assert seen <= expected, sorted(seen - expected)


def test_a_norm_reduced_over_the_whole_pass_is_caught():
    """Negative control: RMSNorm's mean taken over all the pass's rows at once (one reduction whose shape
    follows the pass, the way that gave other bits on an H100) brings signatures outside the set."""
    model = MODELS["default tiles"]
    plain = lambda x, tile: x.pow(2).mean(-1, keepdim=True)  # noqa: E731
    prompts = [[5, 6, 7] * 20 + [8], [5, 6, 7] * 20 + [9, 10]]
    with mock.patch("minillama.model.tiled_mean_square", plain):
        seen = answer(model, prompts, [0, 0], SamplingParams(max_new_tokens=2), {})
    extra = seen - expected_signatures(model, model.tiles) - scan_calls(seen)
    assert extra and all(sig[0] == "aten.mean.dim" for sig in extra), sorted(extra)


def with_short_tiles(signatures: set[tuple], tiles: Tiles) -> set[tuple]:
    """The signatures and, for each linear product of a whole, short or long tile, the same product of every
    other (a pass's last tile may be short, invariant.Tiles.short, and its whole tiles may run as long ones,
    Tiles.long: which ones follow the pass's row count); and for
    each attention call of a whole or short batch of whole or short item tiles, the calls of every other
    (blocks.ItemTiles.short, short_rows, long_rows)."""
    out = set(signatures)
    sizes = (tiles.rows, *tiles.short, *tiles.long)
    for op, args, *rest in signatures:
        if op in ("mkldnn._linear_pointwise.default", "aten.mm.out") and args[0][0][0] in sizes:
            for s in sizes:
                out.add((op, tuple(((s, *a[0][1:]), *a[1:]) if i in (0, 2) else a for i, a in enumerate(args)),
                         *rest))
        for kind in (tiles.attention.whole, tiles.attention.partial):
            rows = (kind.rows, *kind.short_rows, *kind.long_rows)
            shapes = [(r, n) for r in rows for n in (kind.batch, *kind.short)]
            if op == "aten.bmm.out" and (args[0][0][1], args[0][0][0]) in shapes:  # (items, rows, ...) x ...
                d = args[1][0][2] if args[1][0][1] == 64 else args[0][0][2]  # values' (n, B, D) or scores' q
                for r, n in shapes:
                    out |= attention_signatures(r, n, d, args[0][2], tiles.attention.fused)
    return out


def test_varied_layouts_bring_no_new_signature():
    """The same check without the written-out set: what a few layouts use, every other layout uses too (a
    linear product's last tile may be any of the short tiles, its whole tiles any of the long ones)."""
    model = MODELS["default tiles"]
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    doc = rand(150)
    first = answer(model, [doc + rand(5), doc + rand(70)], [0, 0], SamplingParams(max_new_tokens=3), {})
    for n_doc, n_q, q_len in [(0, 1, 1), (500, 9, 30), (63, 3, 2), (64, 1, 64), (1000, 2, 200)]:
        d = rand(n_doc)
        later = answer(model, [d + rand(q_len) for _ in range(n_q)], [0] * n_q, SamplingParams(max_new_tokens=4), {})
        later -= run_calls(later, model.tiles, model.config.head_dim) | scan_calls(later)
        assert later <= with_short_tiles(first, model.tiles), sorted(later - with_short_tiles(first, model.tiles))


def smol(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
                       tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)


def launches(tiles: Tiles, layers: int, docs=1, doc=512, n_q=64, q_len=12, buckets=False) -> tuple[int, int]:
    """(decode step, prefill) work-launching ops of a SmolLM2-shaped model with `layers` layers, counted on
    the CPU: each of `docs` documents and its `n_q` questions prefilled in one pass, then one token for
    every question. The products are counted as `torch.mm`, the form a GPU issues (oneDNN is a CPU's).
    `buckets`: the passes laid out in buckets, as a GPU's captured steps are (step.py)."""
    with mock.patch.dict(os.environ, {GEMM_ENV: "mm"}):
        return _launches(tiles, layers, docs, doc, n_q, q_len, buckets)


def _launches(tiles: Tiles, layers: int, docs: int, doc: int, n_q: int, q_len: int,
              buckets: bool = False) -> tuple[int, int]:
    model = Llama(smol(layers), tiles=tiles)
    if buckets:
        model.steps.bucketed = lambda device: True  # laid out as captured, run eagerly (a CPU captures nothing)
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(docs * (doc + n_q * (q_len + 1)))
    toks, pos, segs, qs = [], [], [], []
    for _ in range(docs):
        d = cache.new_segment()
        q = [cache.new_segment(d) for _ in range(n_q)]
        qs += q
        toks.append(torch.randint(3, 1000, (doc + n_q * q_len,), generator=g))
        pos += [torch.arange(doc), torch.arange(doc, doc + q_len).repeat(n_q)]
        segs += [torch.full((doc,), d), torch.tensor(q).repeat_interleave(q_len)]
    toks, pos, segs = torch.cat(toks), torch.cat(pos), torch.cat(segs)
    with Launches() as prefill:
        model(toks, pos, segs, cache, logits_rows=torch.tensor([len(toks) - 1]))
    with Launches() as step:
        model(toks[:len(qs)], torch.full((len(qs),), doc + q_len), torch.tensor(qs), cache)
    return step.total, prefill.total


def launches_per_layer(tiles: Tiles, doc=512, n_q=64, q_len=12, buckets=False) -> tuple[int, int]:
    """(decode step, prefill) work-launching ops per layer at SmolLM2's shape, counted on the CPU.

    A 2-layer model minus a 1-layer model: the per-pass planning and the LM head cancel out.
    """
    (step1, prefill1), (step2, prefill2) = (launches(tiles, layers, 1, doc, n_q, q_len, buckets) for layers in (1, 2))
    return step2 - step1, prefill2 - prefill1


def test_a_decode_steps_plan_costs_few_launches_whatever_the_number_of_groups():
    """Outside the layers (the plan, embedding, final norm, LM head): at most 100 launches per decode step,
    whether the step's rows form 72 (segment, block) groups (64 questions on one 512-token document) or
    160 (64 questions on each of two 1,024-token documents). The plan is built on the host in whole-pass
    array ops, with one transfer per tensor."""
    outside = []
    for docs, doc in ((1, 512), (2, 1024)):
        (one, _), (two, _) = (launches(CUDA_TILES, layers, docs, doc) for layers in (1, 2))
        outside.append(one - (two - one))  # a 1-layer model's step minus one layer's launches
    assert max(outside) <= 100 and outside[1] <= outside[0], f"launches outside the layers per step: {outside}"


def test_a_layer_issues_few_launches_with_the_gpu_tiles():
    """Launches are what a GPU pays for (a CPU prefers small chunks that stay in its cache: more ops): the
    GPU's tiles, laid out as a plain pass and in buckets (a captured step's layout: its rows padded with zero
    terms, an addition each, `plan.bucket`'s fine sizes). The CPU cannot prove the GPU's scan of those additions."""
    for buckets in (False, True):
        step, prefill = launches_per_layer(CUDA_TILES, buckets=buckets)
        assert step <= 80, f"decode step{' in buckets' * buckets}: {step} launches per layer"
        assert prefill <= 400, f"1,280-token prefill{' in buckets' * buckets}: {prefill} launches per layer"
    cpu_step, cpu_prefill = launches_per_layer(CPU_TILES)
    assert cpu_step <= 120 and cpu_prefill <= 800, (cpu_step, cpu_prefill)
