"""The headline property: parallel prompting gives every question exactly the bits of its stand-alone run.

Random tiny models (1-3 layers, MHA and GQA, several head dims, RoPE theta and Llama-3 scaling, tied or
not; about half of them one of the family: Mistral with sliding windows of 1 to 200 tokens, Qwen2, Qwen3,
attention and MLP biases, linear and yarn RoPE; tests/tiny.py) and random layouts (documents of 0 to a few hundred tokens, 1 to 20 questions of 1 to 60 tokens,
duplicates, several documents per pack, chunked prefill, waves of questions, EOS at random steps, greedy
and sampled). Tokens, finish reasons, log-probs and every step's logits must be torch.equal.
"""

import dataclasses
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillama.config import LlamaConfig
from minillama.generate import SamplingParams, generate
from minillama.invariant import CUDA_TILES
from minillama.model import Llama
from minillama.precision import GEMM_ENV
from test_signatures import expected_signatures, run_calls, scan_calls
from tiny import DEVICE, ON_CPU, SMALL_TILES, VOCAB, configs, ids, tiny_config, tiny_model

EXAMPLES = int(os.environ.get("MINILLAMA_EXAMPLES", "200"))
# Tiles for the property: mostly the small test tiles (fast, and their tiny chunks take the chunked path),
# sometimes the device's defaults, the ones users run; and on any device the GPU's choices too (its big
# tiles and batches, blocks added with one `index_add_`), so a CPU checks the GPU configuration's layout;
# on a CPU, items by the fused kernel too.
TILES = st.sampled_from([SMALL_TILES, SMALL_TILES, dataclasses.replace(SMALL_TILES, attention=dataclasses.replace(SMALL_TILES.attention, index_add=True)), None,
                         CUDA_TILES, *ON_CPU])
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                    derandomize=os.environ.get("CI") == "true")


@st.composite
def workloads(draw):
    n_docs = draw(st.integers(1, 3))
    prompts, docs = [], []
    budget = draw(st.integers(1, 20))  # questions in all
    for d in range(n_docs):
        doc = ids(draw, 0, 300)
        for _ in range(max(1, budget // n_docs)):
            if prompts and docs[-1] == d and draw(st.integers(0, 5)) == 0:
                prompts.append(list(prompts[-1]))  # a duplicate question
            else:
                prompts.append(doc + ids(draw, 1, 60))
            docs.append(d)
    sampled = draw(st.booleans())
    params = SamplingParams(
        max_new_tokens=draw(st.integers(1, 6)), keep_logits=True,
        temperature=draw(st.sampled_from([0.5, 1.0, 1.7])) if sampled else 0.0,
        top_k=draw(st.sampled_from([0, 5, 20])) if sampled else 0,
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5])) if sampled else 1.0,
        seed=draw(st.integers(0, 2**31)),
    )
    eos = draw(st.lists(st.integers(3, VOCAB - 1), max_size=6))  # stops at random steps
    layout = dict(prefill_chunk=draw(st.sampled_from([7, 64, 100, 512])),
                  parallel_size=draw(st.sampled_from([None, 1, 3])),
                  batch_docs=draw(st.sampled_from([None, 1, 2])))
    return prompts, docs, params, eos, layout


def assert_same_answers(expected, got):
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert a.token_ids == b.token_ids, f"question {i}: tokens differ"
        assert a.finish_reason == b.finish_reason, f"question {i}: finish reason differs"
        assert a.logprobs == b.logprobs, f"question {i}: logprobs differ"
        for step, (x, y) in enumerate(zip(a.logits, b.logits, strict=True)):
            assert torch.equal(x, y), f"question {i} step {step}: logits differ by {(x - y).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@SETTINGS
@given(config=configs(), seed=st.integers(0, 1000), work=workloads(), tiles=TILES, unit_pick=st.integers(0, 5),
       ahead=st.booleans())
def test_parallel_equals_independent(dtype, config, seed, work, tiles, unit_pick, ahead):
    """`ahead`: the packed run decodes one step ahead of the host (a GPU's default, generate._decode), the
    stand-alone runs never."""
    prompts, docs, params, eos, layout = work
    model = tiny_model(config, seed, dtype, tiles)
    # products issued whole, or per fixed shards of KV-head groups (the tensor-parallel layout)
    divisors = [u for u in range(1, config.num_key_value_heads + 1) if config.num_key_value_heads % u == 0]
    model.units = divisors[unit_pick % len(divisors)]
    model.steps.overlap = False
    alone = generate(model, prompts, params, mode="independent", eos_ids=eos)
    model.steps.overlap = ahead
    packed = generate(model, prompts, params, mode="parallel", docs=docs, eos_ids=eos, **layout)
    assert_same_answers(alone, packed)


@SETTINGS
@given(config=configs(), seed=st.integers(0, 1000), data=st.data(), tiles=TILES)
def test_nested_and_unrelated_segments_in_one_pass(config, seed, data, tiles):
    """system -> document -> questions, next to unrelated prompts, all in one forward pass."""
    model = tiny_model(config, seed, tiles=tiles)
    system, doc = ids(data.draw, 1, 40), ids(data.draw, 0, 150)
    questions = [ids(data.draw, 1, 30) for _ in range(data.draw(st.integers(1, 4)))]
    others = [ids(data.draw, 1, 80) for _ in range(data.draw(st.integers(0, 3)))]

    cache = model.new_cache()
    s_sys = cache.new_segment()
    s_doc = cache.new_segment(s_sys)
    pieces = [(s_sys, 0, system), (s_doc, len(system), doc)]
    pieces += [(cache.new_segment(s_doc), len(system) + len(doc), q) for q in questions]
    pieces += [(cache.new_segment(), 0, o) for o in others]
    if not doc:
        pieces.pop(1)
    toks = [t for _, _, p in pieces for t in p]
    poss = [s + i for _, s, p in pieces for i in range(len(p))]
    sids = [sid for sid, _, p in pieces for _ in p]
    logits = model(torch.tensor(toks), torch.tensor(poss), torch.tensor(sids), cache)

    offset = len(system) + len(doc)
    row = offset
    for q in questions:  # each question's rows equal its stand-alone prompt's last rows
        alone = model(torch.tensor(system + doc + q))
        assert torch.equal(logits[row:row + len(q)], alone[offset:])
        row += len(q)
    assert torch.equal(logits[:offset], model(torch.tensor(system + doc)))
    for o in others:
        assert torch.equal(logits[row:row + len(o)], model(torch.tensor(o)))
        row += len(o)


@pytest.mark.parametrize("gemm", ["auto", "mm"])
@pytest.mark.parametrize("tiles", ["default", "small", *(["fused"] if ON_CPU else [])])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(6, 3, 1), (10, 1, 1), (6, 4, 2), (6, 1, 1)])
def test_head_sizes_of_narrow_values_products_keep_parity(head_dim, heads, kv_heads, tiles, gemm, monkeypatch):
    """A CPU's bmm gave a row of a 6- or 10-column product other bits at another row of its tile: at head
    size 6 or 10, parallel != independent (by ~5e-7, log-probs too) wherever a document filled a key block,
    and prefill != decode; torch's fused CPU kernel the same. Such products are now issued in whole multiples
    of 8 columns (batched.WIDTH), zeros padding the head size. `torch.mm` the same for a linear layer's
    narrow output (o and down at a hidden size of 6 or 10, MINILLAMA_CPU_GEMM=mm): padded too."""
    monkeypatch.setenv(GEMM_ENV, gemm)
    config = tiny_config(layers=2, heads=heads, kv_heads=kv_heads, head_dim=head_dim, vocab=VOCAB)
    chosen = {"default": None, "small": SMALL_TILES, "fused": ON_CPU[0] if ON_CPU else None}[tiles]
    model = tiny_model(config, seed=5, tiles=chosen)
    g = torch.Generator().manual_seed(0)
    prompts, docs = [], []
    for d, n in enumerate((64, 65, 128)):
        doc = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        prompts += [doc + torch.randint(3, VOCAB, (q,), generator=g).tolist() for q in (3, 15)]
        docs += [d, d]
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    assert_same_answers(generate(model, prompts, params, mode="independent"),
                        generate(model, prompts, params, mode="parallel", docs=docs))


@pytest.mark.parametrize("gemm", ["auto", "mm"])
@pytest.mark.parametrize("hidden", [5, 6, 9, 10])
def test_a_units_narrow_block_at_a_ragged_hidden_size_keeps_parity(hidden, gemm, monkeypatch):
    """torch.mm gave a row of a weight stored row-major with 2 to 11 output columns and K not a multiple of 4
    other bits at another row of its tile: at units = 2 (a unit's q is 8 columns of K = hidden) parallel !=
    independent and prefill != decode at hidden size 5, 6, 9 or 10 under MINILLAMA_CPU_GEMM=mm. A part
    narrower than 16 columns is now padded to 16 (invariant.tiled_linear)."""
    monkeypatch.setenv(GEMM_ENV, gemm)
    model = Llama(LlamaConfig(vocab_size=61, hidden_size=hidden, intermediate_size=48, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms' weights about 1
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 + (p.dim() == 1))
    model.units = 2
    toks = torch.tensor([7, 9, 11, 13])
    cache = model.new_cache(16)
    s = cache.new_segment()
    decoded = torch.cat([model(toks[i:i + 1], torch.tensor([i]), torch.tensor([s]), cache) for i in range(4)])
    assert torch.equal(model(toks), decoded)
    doc = list(range(3, 40))
    prompts = [doc + [50, 51, 52], doc + [41], doc + [44, 45]]
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    assert_same_answers(generate(model, prompts, params, mode="independent"),
                        generate(model, prompts, params, mode="parallel"))


def test_negative_control_plain_ops_break_parity():
    """The same comparison with the invariant primitives switched off finds a mismatch."""
    config = tiny_config(layers=2, heads=6, kv_heads=2, head_dim=32, vocab=512)
    model = tiny_model(config, seed=1)
    g = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 512, (300,), generator=g).tolist()
    prompts = [doc + torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 17, 40, 9, 60, 1, 25, 33)]
    params = SamplingParams(max_new_tokens=4, keep_logits=True, ignore_eos=True)

    def mismatches():
        alone = generate(model, prompts, params, mode="independent")
        packed = generate(model, prompts, params, mode="parallel")
        return sum(not torch.equal(x, y) for a, b in zip(alone, packed) for x, y in zip(a.logits, b.logits))

    model.invariant = False
    assert mismatches() > 0, "plain ops happened to be batch-invariant: the control shows nothing"
    model.invariant = True
    assert mismatches() == 0


def smol_shaped(seed: int, **kw):
    """A random two-layer model with SmolLM2's layer shapes (K up to 1536, where the BLAS splits work across
    threads); `tiles=None` takes the device's default tiles."""
    config = tiny_config(layers=2, heads=9, kv_heads=3, head_dim=64, tied=True, vocab=VOCAB)
    config.intermediate_size = 1536
    return tiny_model(config, seed, **kw)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=os.environ.get("CI") == "true")
@given(seed=st.integers(0, 1000), work=workloads())
def test_parity_at_real_model_shapes(seed, work):
    """SmolLM2's layer shapes (K up to 1536, where the BLAS splits work across threads), two layers."""
    prompts, docs, params, eos, layout = work
    model = smol_shaped(seed)
    alone = generate(model, prompts, params, mode="independent", eos_ids=eos)
    packed = generate(model, prompts, params, mode="parallel", docs=docs, eos_ids=eos, **layout)
    assert_same_answers(alone, packed)


@pytest.mark.parametrize("threads", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_at_more_threads_than_the_machine_has_cores(threads, dtype):
    """A user's CPU has more cores than CI's two, and torch takes one thread per core. Each of torch's parallel
    kernels (the elementwise ops' chunks, oneDNN's products, the reductions) splits its work by the thread count,
    not by the cores it finds, so 4 and 8 threads here split every op as a 4- and an 8-core machine would:
    SmolLM2's layer shapes at the device's default tiles, a pass big enough that every elementwise op of the
    prefill is cut into `threads` chunks, one unit and three, greedy and sampled, chunked and waved. Parallel
    equals independent to the bit, and the plain kernels (the control) differ at the same thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = smol_shaped(threads, tiles=None).to(dtype=dtype)
        g = torch.Generator().manual_seed(threads)
        prompts = doc_prompts(g, 300, (3, 20, 70, 1, 45, 12, 33, 8))
        runs = [(SamplingParams(max_new_tokens=4, keep_logits=True, ignore_eos=True), 1, {}),
                (SamplingParams(max_new_tokens=4, keep_logits=True, ignore_eos=True, temperature=0.8, top_p=0.9,
                                seed=threads), 3, dict(prefill_chunk=100, parallel_size=3))]
        for params, units, layout in runs:
            model.units = units
            alone = generate(model, prompts, params, mode="independent")
            assert_same_answers(alone, generate(model, prompts, params, **layout))
        model.invariant = False  # the control: the same comparison sees the plain kernels' differences
        alone = generate(model, prompts, params, mode="independent")
        packed = generate(model, prompts, params, **layout)
        assert any(not torch.equal(x, y) for a, b in zip(alone, packed) for x, y in zip(a.logits, b.logits))
    finally:
        torch.set_num_threads(saved)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE.type != "cpu", reason="threads are a CPU's")
def test_the_default_model_keeps_parity_at_8_threads():
    """The default model at 8 threads, eight questions about the example document packed as the command packs
    them, at one unit and at the KV heads' three: every step's logits those of each question alone. On the code
    before silu ran in whole vectors, 16 of 32 steps differed at each."""
    import minillama

    root = os.path.join(os.path.dirname(__file__), "..", "examples")
    with open(os.path.join(root, "doc.txt")) as f:
        doc = f.read()
    with open(os.path.join(root, "questions.txt")) as f:
        questions = [line for line in f.read().splitlines() if line.strip()]
    saved = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        model = minillama.load()
        prompts = [model.tokenizer.encode(f"{doc}\nQ: {q}{' ' * i}\nA:") for i, q in enumerate((questions * 2)[:8])]
        params = SamplingParams(max_new_tokens=4, keep_logits=True, ignore_eos=True)
        for units in (1, 3):
            model.llama.units = units
            assert_same_answers(generate(model.llama, prompts, params, mode="independent"),
                                generate(model.llama, prompts, params))
    finally:
        torch.set_num_threads(saved)


def doc_prompts(g: torch.Generator, doc_tokens: int, question_tokens: tuple[int, ...]) -> list[list[int]]:
    """Random stand-alone prompts: one document of `doc_tokens` ids, then each question's own ids."""
    doc = torch.randint(3, VOCAB, (doc_tokens,), generator=g).tolist()
    return [doc + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in question_tokens]


def test_lone_tile_rows_match_rows_of_a_longer_pass():
    """Questions prefilled in one 64-row tile, their stand-alone prompts in four: the same bits."""
    model = smol_shaped(1)
    g = torch.Generator().manual_seed(3)
    prompts = doc_prompts(g, 200, (10, 10))
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    assert_same_answers(generate(model, prompts, params, mode="independent"), generate(model, prompts, params))


def linear_rows(seen) -> set[int]:
    """The row counts of the linear products an audit (`ProductSignatures`) recorded."""
    return {sig[1][0][0][0] for sig in seen.signatures if sig[0] in ("mkldnn._linear_pointwise.default", "aten.mm.out")}


def test_one_sequence_runs_short_tiles_with_the_bits_of_a_full_pass():
    """The device's default tiles at SmolLM2's shapes: a question answered alone decodes one row a step, run
    as a short tile on a CPU (invariant.Tiles.short), its few attention items as a short batch
    (blocks.ItemTiles.short) of 4-row item tiles (ItemTiles.short_rows); packed with others, and prefilled
    in whole tiles and batches, its bits are the same."""
    from minillama.audit import ProductSignatures

    model = smol_shaped(2, tiles=None)
    g = torch.Generator().manual_seed(4)
    prompts = doc_prompts(g, 150, (3, 20, 70))
    params = SamplingParams(max_new_tokens=4, keep_logits=True, ignore_eos=True)
    with ProductSignatures() as seen:
        alone = generate(model, prompts, params, mode="independent")
    assert_same_answers(alone, generate(model, prompts, params))
    rows = linear_rows(seen)
    assert ({4, 64} <= rows) if DEVICE.type == "cpu" else rows == {model.tiles.rows}, rows
    att = model.tiles.attention  # attention's calls: a short last batch of items too (blocks.ItemTiles.short)
    batches = {sig[1][0][0][0] for sig in seen.signatures if sig[0] == "aten.bmm.out"}
    assert (8 in batches) if DEVICE.type == "cpu" else batches <= {att.whole.batch, att.partial.batch}, batches
    item_rows = {sig[1][0][0][1] for sig in seen.signatures if sig[0] == "aten.bmm.out"}  # (items, rows, ...)
    whole_rows = {att.whole.rows, att.partial.rows}  # a CPU's whole-block items: in whole tiles, or long where proven
    cpu = item_rows >= {att.partial.rows, 4} and item_rows & {att.whole.rows, *att.whole.long_rows}
    assert cpu if DEVICE.type == "cpu" else item_rows <= whole_rows, item_rows


def audited_big_pass(model):
    """A packed prefill of a 300-token document and questions of 20, 40 and 60 tokens, three new tokens each,
    under the signature audit: (prompts, params, answers, the audit)."""
    from minillama.audit import ProductSignatures

    prompts = doc_prompts(torch.Generator().manual_seed(5), 300, (20, 40, 60))
    params = SamplingParams(max_new_tokens=3, keep_logits=True, ignore_eos=True)
    with ProductSignatures() as seen:
        packed = generate(model, prompts, params)
    return prompts, params, packed, seen


def test_a_big_pass_runs_long_products_with_the_bits_of_one_product_per_tile():
    """The device's default tiles at SmolLM2's shapes: a packed prefill of several whole tiles runs them as
    long products on a CPU (invariant.Tiles.long, where proven); its answers are those of the same model with
    one product per tile (Tiles.whole_only), and of each question alone."""
    model = smol_shaped(2, tiles=None)
    prompts, params, packed, seen = audited_big_pass(model)
    rows = linear_rows(seen)
    assert (256 in rows) if DEVICE.type == "cpu" else rows == {model.tiles.rows}, rows
    assert_same_answers(generate(model, prompts, params, mode="independent"), packed)
    model.kernels.tiles = model.tiles.whole_only()
    assert_same_answers(generate(model, prompts, params), packed)


def run_rows(seen) -> set[int]:
    """The row counts of attention's runs (blocks.ItemTiles.runs) an audit recorded: oneDNN products against
    one (64, 64) key or value block (no linear layer of SmolLM2's shapes has a (64, 64) weight)."""
    return {sig[1][0][0][0] for sig in seen.signatures
            if sig[0] == "mkldnn._linear_pointwise.default" and sig[1][1][0] == (64, 64)}


def _without_runs(model):
    whole = model.tiles.attention.whole
    return dataclasses.replace(model.tiles, attention=dataclasses.replace(
        model.tiles.attention, whole=dataclasses.replace(whole, runs=0, long_rows=())))  # every item in 32-row tiles


@pytest.mark.parametrize("by_block", [False, True])
def test_a_big_pass_runs_the_items_of_one_key_block_as_one_product_with_the_bits_of_their_batches(by_block):
    """The device's default tiles at SmolLM2's shapes: a packed prefill whose rows meet the document's
    blocks in long stretches takes each stretch as one product against its block on a CPU (ItemTiles.runs,
    where proven); its answers are those of the same model without runs, and of each question alone. Every
    item at once, or (`by_block`: chunks of one batch, none kept) block after block."""
    model = smol_shaped(2, tiles=None)
    if by_block:
        att = model.tiles.attention
        model.kernels.tiles = dataclasses.replace(model.tiles, attention=dataclasses.replace(
            att, keep=0, whole=dataclasses.replace(att.whole, chunk=att.whole.batch)))
    prompts, params, packed, seen = audited_big_pass(model)
    rows = run_rows(seen)
    tile = model.tiles.attention.whole.rows
    assert (rows and min(rows) >= 16 * tile) if DEVICE.type == "cpu" else not rows, rows
    calls = seen.signatures | seen.reductions  # the runs' calls, and every other call in the fixed set
    runs = run_calls(calls, model.tiles, 64)
    assert bool(runs) == (DEVICE.type == "cpu")
    assert calls - runs - scan_calls(calls) <= expected_signatures(model, model.tiles)  # a GPU's proven scans apart
    assert_same_answers(generate(model, prompts, params, mode="independent"), packed)
    model.kernels.tiles = _without_runs(model)
    assert_same_answers(generate(model, prompts, params), packed)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="runs are a CPU's (oneDNN) path")
def test_a_run_of_other_bits_is_refused(monkeypatch):
    """Negative control: a run product whose bits differ from its batch's (here its last bit moved) is refused
    by the proof, so the answers stay those of each question alone; taken unproven, the bits change."""
    from minillama import attention, batched, plan

    real = batched.run_scores
    monkeypatch.setattr(batched, "run_scores", lambda q, k: real(q, k).nextafter_(torch.tensor(float("inf"))))
    monkeypatch.setattr(batched, "_PROVEN", {})
    model = smol_shaped(2, tiles=None)
    prompts = doc_prompts(torch.Generator().manual_seed(5), 300, (20, 40, 60))
    params = SamplingParams(max_new_tokens=2, keep_logits=True, ignore_eos=True)
    alone = generate(model, prompts, params, mode="independent")
    assert_same_answers(alone, generate(model, prompts, params))
    monkeypatch.setattr(attention, "run_scores", batched.run_scores)
    monkeypatch.setattr(plan, "proven_run", lambda kind, d, n, dtype, device: True)  # taken unproven
    with pytest.raises(AssertionError, match="differ"):
        assert_same_answers(alone, generate(model, prompts, params))
