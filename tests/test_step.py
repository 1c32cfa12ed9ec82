"""The step (step.py): fixed shapes, nothing read back to the host, the same bits in every bucket, replayed.

What a GPU's captured step relies on, checked on a CPU:
- the device half of a pass reads no value back (run on the `meta` device, which has no values: any read
  fails there), for a decode step and for a chunked prefill, with planted reads as negative controls;
- the two ways of adding a row's attention terms (block after block; in row order, in a loop the plan's
  shape fixes) give the same bits;
- a step padded to its bucket gives every real row the bits of the unpadded step (padding that adds a real
  term to a row is caught);
- captured steps replay through their static buffers: with a stand-in for the CUDA graph that runs the step
  again from those buffers, answers equal the eager ones, parallel equals independent, and a replay that
  does not see the new inputs is caught.
"""

import copy
import dataclasses
import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import minillama.attention as attention_module
import minillama.batched as batched
import minillama.plan as plan_module
import minillama.precision as precision
import minillama.proofs as proofs
import minillama.step as step_module
import minillama.transfer as transfer
from minillama.attention import blocked_attention
from minillama.audit import host_reads
from minillama.cache import KVCache
from minillama.generate import SamplingParams, generate
from minillama.invariant import CPU_TILES, CUDA_TILES
from minillama.model import RMSNorm
from minillama.plan import plan_attention
from test_attention import WINDOWS, fill, layout
from test_parity import assert_same_answers
from tiny import DEVICE, ON_CPU, SMALL_TILES, tiny_config, tiny_model

DOC = 70


def _document_and_questions(model, doc=DOC, questions=(5, 9, 3)):
    """A cache holding a document and questions under it (prefilled); returns (cache, the question segments)."""
    cache = model.new_cache()
    root = cache.new_segment()
    model(torch.arange(doc) % 50 + 3, torch.arange(doc), torch.full((doc,), root), cache)
    sids = [cache.new_segment(root) for _ in questions]
    toks = torch.cat([torch.arange(n) % 40 + 5 for n in questions])
    segs = torch.cat([torch.full((n,), s) for n, s in zip(questions, sids)])
    poss = torch.cat([torch.arange(doc, doc + n) for n in questions])
    model(toks, poss, segs, cache)
    return cache, sids


def _decode_inputs(cache, sids):
    segs = torch.tensor(sids)
    return torch.tensor([7] * len(sids)), torch.tensor([cache.length(s) for s in sids]), segs


def _on_meta(model, cache, step):
    """Model, cache and step on the meta device: shapes without values."""
    meta_model = copy.deepcopy(model).to("meta")
    meta_model._rope_table(model.dtype)  # made once per device and dtype, by a model's first (eager) step
    meta_cache = copy.copy(cache)
    meta_cache.k, meta_cache.v = cache.k.to("meta"), cache.v.to("meta")
    return meta_model, meta_cache, step.with_tensors([t.to("meta") for t in step.tensors()])


def _reads_of_step(model, cache, tokens, positions, segments, buckets=False):
    step = model.lay_out(cache, tokens, positions, segments, None, buckets=buckets)
    meta_model, meta_cache, meta_step = _on_meta(model, cache, step)
    return host_reads(lambda: meta_model.run_step(meta_cache, meta_step))


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("buckets", [False, True])
def test_a_decode_step_reads_nothing_back_to_the_host(invariant, buckets):
    model = tiny_model(tiny_config())
    model.invariant = invariant
    cache, sids = _document_and_questions(model)
    assert _reads_of_step(model, cache, *_decode_inputs(cache, sids), buckets=buckets) == []


def test_a_chunked_prefill_reads_nothing_back_to_the_host():
    model = tiny_model(tiny_config())  # SMALL_TILES: a prefill of 200 tokens takes the chunked path
    cache = model.new_cache()
    root = cache.new_segment()
    n = 200
    step = model.lay_out(cache, torch.arange(n) % 50, torch.arange(n), torch.full((n,), root), None, buckets=False)
    assert step.plan.order is None and step.plan.whole.count > SMALL_TILES.attention.whole.chunk  # chunks, block by block
    meta_model, meta_cache, meta_step = _on_meta(model, cache, step)
    assert host_reads(lambda: meta_model.run_step(meta_cache, meta_step)) == []


def test_a_read_that_fails_without_a_message_is_still_named():
    """An error with no message (a bare RuntimeError()) is reported by its type, not an IndexError."""
    def run():
        raise RuntimeError()

    assert host_reads(run) == ["RuntimeError: RuntimeError"]


@pytest.mark.parametrize("plant", ["item", "branch", "to_host", "nonzero"])
def test_negative_control_a_planted_read_is_caught(monkeypatch, plant):
    model = tiny_model(tiny_config())
    cache, sids = _document_and_questions(model)
    inputs = _decode_inputs(cache, sids)
    forward = RMSNorm.forward
    reads = {"item": lambda x: x.abs().max().item(), "branch": lambda x: bool((x > 1e9).any()),
             "to_host": lambda x: x.cpu(), "nonzero": lambda x: x.nonzero()}

    def planted(self, x):
        reads[plant](x)
        return forward(self, x)

    monkeypatch.setattr(RMSNorm, "forward", planted)
    assert _reads_of_step(model, cache, *inputs) != []


class Transfers(TorchDispatchMode):
    """Every copy of a host tensor to the meta device: whether it waits (non_blocking False)."""

    def __init__(self):
        super().__init__()
        self.waits: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and \
                str(kwargs.get("device")) == "meta":
            self.waits.append(not kwargs.get("non_blocking", False))
        elif func is torch.ops.aten.copy_.default and args[0].device.type == "meta" and args[1].device.type == "cpu":
            self.waits.append(not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("plant", [False, True])
@pytest.mark.parametrize("decode, buckets", [(True, True), (True, False), (False, True)])
def test_the_host_half_moves_its_inputs_without_waiting(monkeypatch, decode, buckets, plant):
    """Every tensor the host half of a pass puts on the device (the step's inputs, its attention plan) goes
    through pinned memory by a copy that does not wait (transfer.to_device): on a GPU a copy that waits waits
    for the step before, and the host could not lay out a step while the device computes the one before.
    The meta device stands in for a GPU (a CPU-only torch cannot pin memory: `pin` is a stand-in that
    counts). Negative control (`plant`): a plain `.to(device)` in the plan is caught."""
    model = tiny_model(tiny_config())
    cache, sids = _document_and_questions(model)
    cache.k, cache.v = cache.k.to("meta"), cache.v.to("meta")
    pinned = []
    monkeypatch.setattr(transfer, "UNWAITED", {"cuda", "meta"})
    monkeypatch.setattr(transfer, "pin", lambda t: pinned.append(t) or t)
    monkeypatch.setattr(plan_module, "proven_scan", lambda *a: False)  # a proof would run on the device
    if plant:
        monkeypatch.setattr(plan_module, "to_device", lambda t, device: t.to(device))
    inputs = _decode_inputs(cache, sids) if decode else (torch.arange(40) % 30 + 3, torch.arange(40),
                                                         torch.full((40,), cache.new_segment()))
    with Transfers() as seen:
        step = model.lay_out(cache, *inputs, None, buckets=buckets)
    assert step.tokens.device.type == "meta" and step.plan.whole.rows.device.type == "meta"
    assert len(seen.waits) >= 6 and any(seen.waits) == plant, seen.waits
    assert len(pinned) == len(seen.waits) - sum(seen.waits)


@settings(max_examples=25, deadline=None)
@given(qs=st.lists(st.integers(1, 70), min_size=1, max_size=5), doc=st.integers(0, 150), decode=st.booleans(),
       tiles=st.sampled_from([SMALL_TILES, CPU_TILES, CUDA_TILES, *ON_CPU]), window=WINDOWS, seed=st.integers(0, 99),
       buckets=st.booleans())
def test_row_order_adds_the_terms_of_block_order(qs, doc, decode, tiles, window, seed, buckets):
    config = tiny_config(kv_heads=2, heads=4, head_dim=8)
    cache, segs, poss = layout(config, doc, qs, [], decode=decode)
    rows = -(-len(segs) // tiles.rows) * tiles.rows
    big = dataclasses.replace(tiles.attention, keep=1 << 20)  # every pass held at once: the row-order path
    plan = plan_attention(cache, segs, poss, 2, rows, big, window=window, buckets=buckets)
    q = fill(cache, rows, 2, seed)
    assert plan.order is not None
    in_row_order = blocked_attention(q, cache.k[0], cache.v[0], plan, big)
    by_block = blocked_attention(q, cache.k[0], cache.v[0], dataclasses.replace(plan, order=None), big)
    assert torch.equal(in_row_order, by_block)


def test_a_rows_terms_pad_finely_unless_each_shape_costs_a_compile():
    """A decode step whose rows add 9 terms (a 520-token document): J is 9 laid out plainly, 12 in the buckets
    a captured step takes (powers of two and 1.5 times them: 3 zero terms, not 7), 16 in a compiled step's
    (powers of two: fewer shapes, each a compile)."""
    cache, segs, poss = layout(tiny_config(kv_heads=2, heads=4, head_dim=8), 520, [3, 5], [], decode=True)
    big = dataclasses.replace(SMALL_TILES.attention, keep=1 << 20)
    terms = [plan_attention(cache, segs, poss, 2, 16, big, buckets=buckets, at_once=at_once).order.shape[1]
             for buckets, at_once in ((False, False), (True, False), (True, True))]
    assert terms == [9, 12, 16]


def _row_order_against_by_block(scan: bool) -> tuple[bool, bool]:
    """A decode step's attention (3 questions on a 150-token document, 7 terms a row) with `plan.scan` as given
    (its row-order additions as one scan): (the plan's own scan, row order == block order to the bit)."""
    config = tiny_config(kv_heads=2, heads=4, head_dim=8)
    cache, segs, poss = layout(config, 150, [9, 30, 70], [], decode=True)
    big = dataclasses.replace(SMALL_TILES.attention, keep=1 << 20)
    plan = plan_attention(cache, segs, poss, 2, 16, big, buckets=True)
    q = fill(cache, 16, 2, 0)
    in_row_order = blocked_attention(q, cache.k[0], cache.v[0], dataclasses.replace(plan, scan=scan), big)
    return plan.scan, torch.equal(in_row_order, blocked_attention(q, cache.k[0], cache.v[0],
                                                                  dataclasses.replace(plan, order=None), big))


def test_a_scan_adds_the_terms_only_where_proven(monkeypatch):
    """The row order's J additions go as one `cumsum` only where the process proved it gives their bits
    (batched.proven_scan: a GPU's); a CPU's `cumsum` adds float32 in double, so it is refused there, and
    taken unproven it breaks block order's bits (the negative control). With a stand-in scan that adds in
    order, the scanned path gives block order's bits."""
    proven, same = _row_order_against_by_block(scan=False)
    assert same
    if DEVICE.type == "cpu":
        assert not proven and not _row_order_against_by_block(scan=True)[1]  # unproven: other bits
        assert not batched.scan_matches((579, 9, 65), torch.float32, DEVICE)  # the proof sees the CPU's sums

        def in_order(ordered):
            calls.append(ordered.shape)
            return batched.sums_in_order(ordered)

        calls = []
        monkeypatch.setattr(attention_module, "scan_sums", in_order)
        assert _row_order_against_by_block(scan=True)[1] and calls
        monkeypatch.setattr(batched, "scan_sums", in_order)
        assert batched.scan_matches((579, 9, 65), torch.float32, DEVICE)  # and passes a scan that adds in order


def _steps_in_lockstep(model, steps=3):
    """Logits of a prefill of questions (85 tokens: 6 tiles of 16 rows, a bucket of 8) and `steps` decode
    steps, laid out without and with buckets: [(step's key, logits), ...] each. One question reaches a
    block further than the others, so rows differ in their number of terms."""
    questions = (5, 9, 3, 60, 8)
    out = []
    for buckets in (False, True):
        cache = model.new_cache()
        root = cache.new_segment()
        model(torch.arange(DOC) % 50 + 3, torch.arange(DOC), torch.full((DOC,), root), cache)
        sids = [cache.new_segment(root) for _ in questions]
        passes = [(torch.cat([torch.arange(n) % 40 + 5 for n in questions]),
                   torch.cat([torch.arange(DOC, DOC + n) for n in questions]),
                   torch.cat([torch.full((n,), s) for n, s in zip(questions, sids)]))]
        got = []
        for i in range(steps + 1):
            inputs = passes[0] if i == 0 else _decode_inputs(cache, sids)
            step = model.lay_out(cache, *inputs, None, buckets=buckets)
            got.append((step.key(), model.run_step(cache, step)[:step.wanted]))
        out.append(got)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bucket_never_changes_a_real_rows_bits(dtype):
    model = tiny_model(tiny_config(), dtype=dtype)
    plain, bucketed = _steps_in_lockstep(model)
    assert plain[0][0][0] != bucketed[0][0][0]  # the prefill's rows were padded to the bucket
    assert all(k1 != k2 for (k1, _), (k2, _) in zip(plain, bucketed))  # and every step's items or terms
    for (_, a), (_, b) in zip(plain, bucketed):
        assert torch.equal(a, b)


def test_padding_rows_skip_attention_and_change_no_bit(monkeypatch):
    """A step of a few tokens in a 256-row linear tile (a GPU's, where it proves no short tile) attends over a
    bucket of its own rows (AttentionPlan.rows: 16 for 5 tokens, 128 for 85), not the tile's 256; its logits
    are those of the same steps attending over every padded row (ATTENTION_ROWS that large: the layout
    before plan.rows)."""
    model = tiny_model(tiny_config(), tiles=dataclasses.replace(CUDA_TILES, short=()))
    lay, steps = model.lay_out, []
    model.lay_out = lambda *a, **k: steps.append(lay(*a, **k)) or steps[-1]
    trimmed = _steps_in_lockstep(model)[1]  # [(key, logits)] of the steps laid out in buckets
    assert [(s.plan.rows, s.tokens.shape[0]) for s in steps[-4:]] == [(128, 256)] + [(16, 256)] * 3
    monkeypatch.setattr(step_module, "ATTENTION_ROWS", 1 << 20)
    full = _steps_in_lockstep(model)[1]
    assert [s.plan.rows for s in steps[-4:]] == [256] * 4  # every padded row attended
    for (_, a), (_, b) in zip(trimmed, full):
        assert torch.equal(a, b)


def _bucketed_steps(tiles):
    """`_steps_in_lockstep`'s steps laid out in buckets (a GPU's captured layout) with `tiles`: [(step, its
    wanted logits)]."""
    model = tiny_model(tiny_config(), tiles=tiles)
    lay, laid = model.lay_out, []
    model.lay_out = lambda *a, **k: laid.append(lay(*a, **k)) or laid[-1]
    logits = [b for _, b in _steps_in_lockstep(model)[1]]
    return list(zip(laid[-len(logits):], logits))


WHOLE_ITEMS = dataclasses.replace(CUDA_TILES, attention=CUDA_TILES.whole_only().attention)


def test_a_bucket_takes_the_short_item_tiles_and_batches_its_device_proves():
    """Steps in buckets (a GPU's, captured) take a short item tile where every group of a kind fits one, and a
    short batch where a kind has fewer items than a batch, exactly where the device proves them (batched.py,
    in the host half): with the GPU's tiles, 5 questions' decode steps bring 2 rows (G) to each question's own
    masked block and 10 to the document's, which take 4- and 16-row tiles in short batches on this CPU, not
    16 and 128 rows in batches of 512 and 128. Every step's logits equal those of whole tiles and batches."""
    short, whole = _bucketed_steps(CUDA_TILES), _bucketed_steps(WHOLE_ITEMS)
    a = CUDA_TILES.attention
    d = tiny_config().head_dim
    tile = {kind: plan_module.last_tile(rows, kind.rows, batched.proven_rows(kind, d, torch.float32, DEVICE))
            for kind, rows in ((a.whole, 10), (a.partial, 2))}
    assert len(short) == len(whole) == 4
    for (_, logits), (_, whole_logits) in zip(short, whole):
        assert torch.equal(logits, whole_logits)
    for step, _ in short[1:]:  # the decode steps
        assert (step.plan.whole.rows.shape[1], step.plan.partial.rows.shape[1]) == (tile[a.whole], tile[a.partial])
        assert step.plan.whole.count <= a.whole.batch and step.plan.partial.count <= a.partial.batch
    for step, _ in whole[1:]:
        assert step.plan.whole.rows.shape == (a.whole.batch, a.whole.rows)
        assert step.plan.partial.rows.shape == (a.partial.batch, a.partial.rows)
    if DEVICE.type == "cpu":  # this CPU's kernels prove them all (float32, oneDNN's and MKL's bmm)
        assert [step.plan.partial.rows.shape for step, _ in short[1:]] == [(64, 4)] * 3
        assert [step.plan.whole.rows.shape for step, _ in short[1:]] == [(16, 16)] * 3


def test_negative_control_a_bucket_refuses_an_item_tile_of_other_bits(monkeypatch):
    """A library whose 4-row items add in another order (`torch.bmm` nudging the last bit) proves no 4-row
    tile: the decode steps' own blocks go in 8-row tiles, with the whole tiles' bits; taken unproven, the
    4-row tiles change them."""
    from test_attention import _nudge_bmm

    _nudge_bmm(monkeypatch, lambda a: a.shape[1] == 4)
    whole = _bucketed_steps(WHOLE_ITEMS)
    refused = _bucketed_steps(CUDA_TILES)
    kind = CUDA_TILES.attention.partial
    tile = plan_module.last_tile(2, kind.rows, batched.proven_rows(kind, tiny_config().head_dim, torch.float32, DEVICE))
    assert tile > 4 and (tile == 8 or DEVICE.type != "cpu")  # this CPU proves 8 rows; a GPU may refuse them
    assert [step.plan.partial.rows.shape[1] for step, _ in refused[1:]] == [tile] * 3
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(refused, whole))
    monkeypatch.setattr(plan_module, "proven_rows", lambda kind, d, dtype, device: kind.short_rows)  # unproven
    taken = _bucketed_steps(CUDA_TILES)
    assert [step.plan.partial.rows.shape[1] for step, _ in taken[1:]] == [4] * 3
    assert not all(torch.equal(x, y) for (_, x), (_, y) in zip(taken, whole))


def test_negative_control_padding_that_adds_a_real_term_is_caught(monkeypatch):
    row_order = plan_module.row_order

    def leaky(rows_of_kind, flat_rows, row_stride, buckets):  # in buckets, padding points at term 0, not the zero term
        table = row_order(rows_of_kind, flat_rows, row_stride, buckets)
        if buckets:
            table[table == table.max()] = 0
        return table

    monkeypatch.setattr(plan_module, "row_order", leaky)
    plain, bucketed = _steps_in_lockstep(tiny_model(tiny_config()))
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(plain, bucketed))


class Rerun:
    """A stand-in for a CUDA graph on a CPU: 'replaying' runs the captured function again, from the static
    buffers it was captured over, into its output buffer. `frozen` replays nothing (a stale graph)."""

    def __init__(self, frozen=False):
        self.frozen, self.captures, self.replays = frozen, 0, 0

    def __call__(self, run, pool=None):
        self.captures += 1
        out = run()

        def replay():
            self.replays += 1
            if not self.frozen:
                out.copy_(run())
        return replay, out


def _captured(model, capture):
    model.steps.captured, model.steps.capture = True, capture
    return model


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 3], [5, 6, 7, 8, 9, 10, 12, 13, 4], [5, 6, 7, 8, 9, 10, 14]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.8, seed=3, keep_logits=True, ignore_eos=True)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("mode", ["parallel", "independent"])
def test_captured_steps_replay_the_eager_bits(mode, ahead):
    """`ahead`: decoding one step ahead of the host, as on a GPU (its token ids the step before's choice)."""
    eager = generate(tiny_model(tiny_config()), PROMPTS, PARAMS, mode=mode)
    capture = Rerun()
    model = _captured(tiny_model(tiny_config()), capture)
    model.steps.overlap = ahead
    replayed = generate(model, PROMPTS, PARAMS, mode=mode)
    assert capture.captures >= 1 and capture.replays > capture.captures  # steps were replayed, not rerun
    assert_same_answers(eager, replayed)


class ProvedBefore(Rerun):
    """A capture stand-in that fails where the captured step makes a proof (proofs.py): a GPU's proofs read
    their results back, which a CUDA graph's capture refuses. `forget`: the proofs are dropped just before
    each capture, as if the step had not run eagerly first (the negative control)."""

    def __init__(self, forget=False):
        super().__init__()
        self.forget = forget

    def __call__(self, run, pool=None):
        if self.forget:
            proofs._PROVEN.clear()
        made = dict(proofs._PROVEN)
        out = super().__call__(run, pool)
        assert proofs._PROVEN == made, f"proofs made in a capture: {set(proofs._PROVEN) - set(made)}"
        return out


@pytest.mark.skipif(not ON_CPU, reason="the CPU's proofs stand in for a GPU's")
def test_a_captured_step_makes_no_proof(monkeypatch):
    """On a GPU, short tiles and units as one product are proven in the step that first meets a weight's
    shape (proofs.py). That step runs eagerly, so the capture of the bucket's second step finds every proof
    made: with the GPU's tiles (short tiles) and units (one product over them), greedy and sampled, in
    parallel and alone, one step ahead of the host. Negative control: proofs dropped before each capture."""
    monkeypatch.setattr(proofs, "_PROVEN", {})
    for mode, ahead in (("parallel", True), ("independent", False)):
        model = _captured(tiny_model(tiny_config(), tiles=CUDA_TILES), ProvedBefore())
        model.units, model.steps.overlap = 2, ahead
        generate(model, PROMPTS, PARAMS, mode=mode)
        assert model.steps.capture.captures >= 1 and proofs._PROVEN  # steps captured, proofs made
    model = _captured(tiny_model(tiny_config(), tiles=CUDA_TILES), ProvedBefore(forget=True))
    model.units = 2
    with pytest.raises(AssertionError, match="proofs made in a capture"):
        generate(model, PROMPTS, PARAMS)


def test_a_cache_grown_in_a_pass_is_a_spare_the_next_call_can_take():
    """A cache that grows inside a forward pass (inference mode: answers past its reserve, or the serve engine's
    cache) becomes the spare storage of captured steps, which the next call zeroes outside one. Its storage is an
    ordinary tensor, so that works. Negative control: the H200 run at f9e71c4 failed here (`gpu_check`'s first
    step), as the code before did on a CPU: 'Inplace update to inference tensor outside InferenceMode'."""
    model = _captured(tiny_model(tiny_config()), Rerun())
    first = generate(model, PROMPTS, SamplingParams(max_new_tokens=300, ignore_eos=True), mode="independent")
    gc.collect()
    assert model.steps.spare is not None and not model.steps.spare.k.is_inference()
    assert all(len(a.token_ids) == 300 for a in first)
    assert_same_answers(generate(tiny_model(tiny_config()), PROMPTS, PARAMS), generate(model, PROMPTS, PARAMS))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real CUDA graphs need a CUDA device (the CPU runs a stand-in)")
def test_real_graphs_of_one_cache_after_another_replay_the_eager_bits():
    """Each question alone, twice: many caches, each with graphs of its own that die with it. (Graphs of every
    cache in one process-wide pool failed here: the allocator refused a pool whose graphs had all died.)"""
    model = tiny_model(tiny_config())
    assert model.steps.capturing(model.device)
    model.steps.captured = False
    eager = generate(model, PROMPTS, PARAMS, mode="independent")
    model.steps.captured = None  # the default on CUDA: captured
    for _ in range(2):
        assert_same_answers(eager, generate(model, PROMPTS, PARAMS, mode="independent"))


def test_captured_steps_outlive_a_generate_call():
    """A later call's cache is made on the earlier one's storage, zeroed, and replays its graphs: a bucket met
    twice over two calls is captured once, nothing is captured twice, and the answers are the eager ones."""
    eager = generate(tiny_model(tiny_config()), PROMPTS, PARAMS)
    capture = Rerun()
    model = _captured(tiny_model(tiny_config()), capture)
    answers = []
    for _ in range(3):
        answers.append(generate(model, PROMPTS, PARAMS))
        assert model.steps.spare is not None
    captures, replays = capture.captures, capture.replays
    assert captures >= 1
    spare = model.steps.spare
    answers.append(generate(model, PROMPTS, PARAMS))
    assert capture.captures == captures and capture.replays > replays  # replayed, not captured again
    assert model.steps.spare is spare  # the same storage, kept again for the next call
    for replayed in answers:
        assert_same_answers(eager, replayed)


def test_a_cache_on_the_spare_storage_starts_as_a_fresh_one():
    model = _captured(tiny_model(tiny_config()), Rerun())
    generate(model, PROMPTS, PARAMS)
    k = model.steps.spare.k
    assert bool(k.any())  # the finished run's keys are still there
    cache = model.new_cache(8)
    assert cache.k is k and not cache.k.any() and not cache.v.any() and model.steps.spare is None
    assert len(cache._free) == k.shape[2] - 2  # every slot but the two held back
    assert model.new_cache(8).k is not k  # taken: a second live cache gets storage of its own
    del cache
    assert model.new_cache(k.shape[2] + 1).k is not k  # the spare is too small for this one



def test_two_threads_never_take_one_spare(monkeypatch):
    """Two threads' new caches (two generate calls on one model, as a threaded server's) both find the spare:
    one takes it, the other gets storage of its own. A thread switch between reading the spare and taking it
    (here a sleep in `KVCache.holds`) once gave both caches the one storage, each writing the other's keys."""
    model = _captured(tiny_model(tiny_config()), Rerun())
    generate(model, PROMPTS, PARAMS)
    holds = KVCache.holds
    monkeypatch.setattr(KVCache, "holds", staticmethod(lambda *a: time.sleep(0.05) or holds(*a)))
    caches = []
    threads = [threading.Thread(target=lambda: caches.append(model.new_cache())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(caches) == 2 and caches[0].k.data_ptr() != caches[1].k.data_ptr()


def test_a_cache_retired_while_the_weights_move_leaves_no_stale_spare(monkeypatch):
    """`forget` (the weights moved) runs while a cache is retired: by another thread, or by a finalizer the
    collector runs inside `forget` itself. The retired cache's graphs read the old weights; made the spare, a
    new cache would replay them. Here the retirement lands in the middle of `forget`'s walk over the caches."""
    model = _captured(tiny_model(tiny_config()), Rerun())
    generate(model, PROMPTS, PARAMS)
    steps = model.steps
    stale = [object()]  # a retired cache's graphs (forget and retire never look inside)

    class Retiring(weakref.WeakKeyDictionary):
        def values(self):
            steps._retire(stale)  # a cache collected during the walk
            return super().values()

    boxes = Retiring()
    boxes.update(steps._by_cache)
    monkeypatch.setattr(steps, "_by_cache", boxes)
    steps.forget()
    assert steps.spare is None


def test_captured_steps_follow_the_kernels_and_the_weights():
    """A step replays another graph when the kernels change (32-row linear tiles: the same step tensors, other
    launches; other attention items: on a CPU the fused attention kernel, a CPU's own, on a GPU masked items of
    other rows; plain products); moving the weights (`.to()`, a new layout, a load) drops the spare, whose graphs
    read them where they were."""
    other = dataclasses.replace(CPU_TILES.attention, fused=True) if DEVICE.type == "cpu" else \
        dataclasses.replace(CUDA_TILES.attention, partial=dataclasses.replace(CUDA_TILES.attention.partial, rows=16))
    attention = dataclasses.replace(CPU_TILES, attention=other)
    capture = Rerun()
    model = _captured(tiny_model(tiny_config()), capture)
    for _ in range(2):
        generate(model, PROMPTS, PARAMS)
    for change in (lambda m: setattr(m.kernels, "tiles", dataclasses.replace(CPU_TILES, rows=32)),  # same shapes
                   lambda m: setattr(m.kernels, "tiles", attention), lambda m: setattr(m, "invariant", False)):
        reference = _captured(tiny_model(tiny_config()), Rerun())  # the change from the start
        change(reference)
        generate(reference, PROMPTS, PARAMS)
        change(model)
        captures = capture.captures
        answers = [generate(model, PROMPTS, PARAMS) for _ in range(2)]
        assert capture.captures > captures  # graphs of their own (the stand-in would rerun the new kernels)
        assert_same_answers(generate(reference, PROMPTS, PARAMS), answers[-1])
    assert model.steps.spare is not None
    model.to(torch.float64)
    assert model.steps.spare is None


def test_a_chunked_prefill_is_never_captured():
    """Its attention loops over the plan's distinct blocks, which two passes of one shape need not share."""
    capture = Rerun()
    model = _captured(tiny_model(tiny_config()), capture)
    cache = model.new_cache(1024)  # room for all: the cache never grows (which would drop its graphs)
    for _ in range(3):  # three 200-token documents: one shape, chunked attention
        root = cache.new_segment()
        model(torch.arange(200) % 50, torch.arange(200), torch.full((200,), root), cache)
    assert capture.captures == 0
    sids = [cache.new_segment(root) for _ in range(3)]  # control: decode steps of one shape are captured
    for _ in range(3):
        model(*_decode_inputs(cache, sids), cache)
    assert capture.captures == 1


@pytest.mark.parametrize("tiles", [None, CUDA_TILES])
def test_captured_parallel_equals_captured_independent(tiles):
    """In buckets, with the device's tiles and the GPU's (whose short item tiles and batches the questions
    alone take far more of than the pack)."""
    model = _captured(tiny_model(tiny_config(kv_heads=1, heads=3), tiles=tiles), Rerun())
    assert_same_answers(generate(model, PROMPTS, PARAMS, mode="independent"),
                        generate(model, PROMPTS, PARAMS, mode="parallel"))


def test_negative_control_a_replay_that_misses_new_inputs_is_caught():
    eager = generate(tiny_model(tiny_config()), PROMPTS, PARAMS)
    stale = generate(_captured(tiny_model(tiny_config()), Rerun(frozen=True)), PROMPTS, PARAMS)
    assert [a.token_ids for a in eager] != [a.token_ids for a in stale] or \
        not all(torch.equal(x, y) for a, b in zip(eager, stale) for x, y in zip(a.logits, b.logits))


def test_captured_steps_are_refused_off_cuda_without_a_stand_in():
    model = tiny_model(tiny_config())
    model.steps.captured = True
    if DEVICE.type == "cuda":
        pytest.skip("on CUDA captured steps are the real thing (test_captured_steps_replay_the_eager_bits)")
    with pytest.raises(ValueError, match="captured steps need a CUDA device"):
        model(torch.tensor([1, 2, 3]))


def _graph_breaks(model, cache, step):
    import torch._dynamo

    torch._dynamo.reset()
    return torch._dynamo.explain(model.run_step)(cache, step).graph_break_count


def test_torch_compile_traces_a_step_whole():
    """`torch.compile(model.run_step, fullgraph=True)` can take a decode step and a chunked prefill: one
    graph each, no break (docs/gpu.md: what compiling it gives on a CPU)."""
    model = tiny_model(tiny_config())
    cache, sids = _document_and_questions(model)
    decode = model.lay_out(cache, *_decode_inputs(cache, sids), None, buckets=True)
    assert _graph_breaks(model, cache, decode) == 0
    root = cache.new_segment()
    prefill = model.lay_out(cache, torch.arange(200) % 50, torch.arange(200), torch.full((200,), root), None,
                      buckets=False)
    assert prefill.plan.order is None and _graph_breaks(model, cache, prefill) == 0


def test_the_compilers_constants_carry_torchs_own_mark():
    """precision.compiler_constant sets what torch.compiler.assume_constant_result sets (without importing
    torch._dynamo at start): the same attributes, so torch.compile takes both alike."""
    def torchs():
        return 1

    def ours():
        return 1

    torch.compiler.assume_constant_result(torchs)
    precision.compiler_constant(ours)
    assert vars(torchs) and vars(ours) == vars(torchs)
    assert vars(precision.compute_dtype).items() >= vars(torchs).items()
    assert vars(precision.uses_onednn).items() >= vars(torchs).items()


def test_answering_imports_no_compiler():
    """Importing minillama's entry points and answering on a CPU leave torch._dynamo unimported (~1 s of
    every start); `--compile` imports it when it compiles."""
    code = ("import sys, torch; import minillama.cli, minillama.api, minillama.oracle, minillama.oracle.backends; "
            "from minillama.generate import generate, SamplingParams; sys.path.insert(0, 'tests'); "
            "from tiny import tiny_config, tiny_model; "
            "m = tiny_model(tiny_config()); generate(m, [[1, 2, 3], [1, 2, 4]], SamplingParams(max_new_tokens=3)); "
            "print(sorted(n for n in sys.modules if n.startswith('torch._dynamo'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_negative_control_a_planted_read_breaks_the_graph(monkeypatch):
    model = tiny_model(tiny_config())
    cache, sids = _document_and_questions(model)
    step = model.lay_out(cache, *_decode_inputs(cache, sids), None, buckets=False)
    forward = RMSNorm.forward
    monkeypatch.setattr(RMSNorm, "forward", lambda self, x: forward(self, x) if x.abs().max().item() >= 0 else x)
    assert _graph_breaks(model, cache, step) > 0
