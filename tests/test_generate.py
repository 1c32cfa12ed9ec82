"""Generation modes and sampling on token ids (parity itself is in test_parity.py)."""

import dataclasses
import random
import signal
import threading
import time

import pytest
import torch

from minillama.generate import SamplingParams, Stats, StreamTooLong, generate, sample, shared_prefix_length
import minillama.tokens as tokens_module
import minillama.transfer as transfer
from minillama.sampling import gumbel, sample_rows, sorted_rows, uniforms
from test_parity import assert_same_answers
from tiny import tiny_config, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8), seed=5)


def _prompts(n=5, doc=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(3, 61, (doc,), generator=g).tolist()
    return [d + torch.randint(3, 61, (int(k),), generator=g).tolist() for k in torch.randint(1, 20, (n,), generator=g)]


def test_shared_prefix_leaves_each_prompt_a_token():
    assert shared_prefix_length([[1, 2, 3], [1, 2, 4]]) == 2
    assert shared_prefix_length([[1, 2], [1, 2, 3]]) == 1
    assert shared_prefix_length([[5, 6, 7]]) == 2
    assert shared_prefix_length([[1], [2]]) == 0


def test_finish_reasons_and_stop_rules(model):
    prompts = _prompts()
    free = generate(model, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert all(a.finish_reason == "length" and len(a.token_ids) == 12 for a in free)
    stop_id = free[0].token_ids[4]
    stopped = generate(model, prompts, SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)))
    a = stopped[0]
    assert a.finish_reason == "stop" and a.token_ids[-1] == stop_id
    assert a.token_ids == free[0].token_ids[:len(a.token_ids)]
    by_fn = generate(model, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=lambda ids: len(ids) == 3))
    assert all(x.finish_reason == "stop" and len(x.token_ids) == 3 for x in by_fn)
    assert all(x.token_ids == [] for x in generate(model, prompts, SamplingParams(max_new_tokens=0)))


@pytest.mark.parametrize("mode", ["parallel", "independent", "seqbatch"])
def test_no_answer_to_give_runs_no_pass(model, mode):
    """At max_new_tokens=0 parallel mode prefilled the document anyway (96 tokens, one pass, for
    examples/ at -n 0) where the other modes ran nothing."""
    stats = Stats()
    answers = generate(model, _prompts(), SamplingParams(max_new_tokens=0), mode=mode, stats=stats)
    assert [a.token_ids for a in answers] == [[]] * len(answers)
    assert (stats.forward_passes, stats.prompt_tokens) == (0, 0)


def test_finished_questions_drop_out_of_decode_steps(model):
    prompts = _prompts(n=4)
    full = generate(model, prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    wanted = [2, 5, 9, 12]  # stop question i after wanted[i] tokens, through the stop callback
    targets = [a.token_ids[:n] for a, n in zip(full, wanted)]
    rule = SamplingParams(max_new_tokens=12, ignore_eos=True, stop=lambda ids: ids in targets)
    counts, stats = [], Stats()
    answers = generate(model, prompts, rule, on_token=counts.append, stats=stats)
    assert [len(a.token_ids) for a in answers] == wanted
    assert counts == [4, 4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1]  # rows per forward pass shrink as questions finish
    assert stats.generated_tokens == sum(wanted)


def test_sampling_is_seeded_per_question(model):
    prompts = _prompts()
    p = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.9, seed=11, ignore_eos=True)
    a, b = generate(model, prompts, p), generate(model, prompts[:2], p)
    assert [x.token_ids for x in a[:2]] == [x.token_ids for x in b]
    c = generate(model, prompts, SamplingParams(**{**p.__dict__, "seed": 12}))
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_every_seed_has_a_stream_of_its_own(model):
    """Seeds 2**63 apart (-1 and 2**63 - 1, -2**63 and 0) shared a stream: the keys were taken modulo 2**63.
    Ordinary seeds keep the keys (and answers) they had."""
    from minillama.sampling import stream_key

    edges = [-2**63, -2**63 + 1, -1, 0, 1, 2**62, 2**63 - 1]
    assert len({stream_key(s, 0) for s in edges}) == len(edges)
    assert all(-2**63 <= stream_key(s, i) < 2**63 for s in edges for i in (0, 1, 10**6))
    assert [stream_key(s, i) for s, i in ((0, 0), (11, 3), (2**40, 7))] == [0, 11_000_036, 2**40 * 1_000_003 + 7]
    p = SamplingParams(max_new_tokens=6, temperature=1.0, seed=-1, ignore_eos=True)
    prompts = _prompts()[:3]
    answers = [[x.token_ids for x in generate(model, prompts, SamplingParams(**{**p.__dict__, "seed": s}))]
               for s in (-1, 2**63 - 1)]
    assert answers[0] != answers[1]


def test_sample_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 4.8])
    assert sample(logits, SamplingParams(), 0, 0) == 1
    picks = {sample(logits, SamplingParams(temperature=1.0, top_k=2), 0, t) for t in range(200)}
    assert picks == {1, 2}
    picks = {sample(logits, SamplingParams(temperature=1.0, top_p=0.3), 0, t) for t in range(100)}
    assert picks == {1}
    picks = [sample(logits, SamplingParams(temperature=1.0), 5, t) for t in range(4000)]
    freq = torch.bincount(torch.tensor(picks), minlength=5).double() / len(picks)
    assert torch.allclose(freq, torch.softmax(logits.double(), -1), atol=0.03)  # the draws follow softmax


def test_seqbatch_answers_in_one_stream(model):
    prompts = _prompts(n=3)
    stats = Stats()
    answers = generate(model, prompts, SamplingParams(max_new_tokens=5, ignore_eos=True), mode="seqbatch",
                       stats=stats)
    assert [len(a.token_ids) for a in answers] == [5, 5, 5]
    alone = generate(model, prompts[:1], SamplingParams(max_new_tokens=5, ignore_eos=True), mode="independent")
    assert answers[0].token_ids == alone[0].token_ids  # the first answer has seen nothing else
    assert stats.prompt_tokens == len(prompts[0]) + sum(len(p) - 90 for p in prompts[1:]) + 2


def test_a_seqbatch_stream_overflows_only_when_it_runs():
    """At max_new_tokens=0 no pass runs, yet seqbatch added every question to its stream and refused it past the
    context after every answer was given (700 questions on examples/doc.txt); with answers, it still does."""
    small = tiny_model(tiny_config(layers=1, max_pos=128), seed=5)
    prompts = _prompts(n=40, doc=20)
    assert sum(len(p) - 20 for p in prompts) > 128  # the questions alone outgrow the context
    stats = Stats()
    answers = generate(small, prompts, SamplingParams(max_new_tokens=0), mode="seqbatch", stats=stats)
    assert [a.token_ids for a in answers] == [[]] * len(prompts) and stats.forward_passes == 0
    with pytest.raises(StreamTooLong, match=r"longer than the model's context \(128\)"):
        generate(small, prompts, SamplingParams(max_new_tokens=1), mode="seqbatch")


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=-1), "max_new_tokens"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
])
def test_bad_sampling_params(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


def test_bad_requests(model):
    with pytest.raises(ValueError, match="unknown mode"):
        generate(model, [[1, 2]], mode="fast")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []])
    with pytest.raises(ValueError, match="context is 2048"):
        generate(model, [[3] * 2048])
    for name in ("on_token", "on_answer"):  # at the call, not after the prefill in words naming neither
        with pytest.raises(TypeError, match=f"^{name} must be a function or None, got 3$"):
            generate(model, [[1, 2]], **{name: 3})


@pytest.mark.parametrize("mode", ["parallel", "independent", "seqbatch"])
def test_on_answer_reports_each_answer_once_when_it_finishes(model, mode):
    prompts = _prompts()
    seen: list[tuple[int, int]] = []  # (index, tokens the answer had when reported)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, stop=lambda ids: len(ids) == 1 + ids[0] % 8)
    answers = generate(model, prompts, params, mode=mode,
                       on_answer=lambda i, a: seen.append((i, len(a.token_ids))))
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert all(n == len(answers[i].token_ids) for i, n in seen)
    zero = []
    generate(model, prompts, SamplingParams(max_new_tokens=0), mode=mode, on_answer=lambda i, a: zero.append(i))
    assert sorted(zero) == list(range(len(prompts)))


@pytest.mark.parametrize("mode", ["parallel", "independent"])
def test_a_pass_sizes_its_cache_once(model, monkeypatch, mode):
    """A parallel pass's document and questions (1,000+ tokens here), or an independent question's prompt
    (600+), get their slots in one reallocation, not by doubling the cache from its initial size (each
    doubling zero-fills and copies all of it)."""
    from minillama.cache import KVCache

    grown, grow = [], KVCache._grow

    def counted(self, *a, **kw):
        grown.append(self.k.shape[2])
        return grow(self, *a, **kw)

    monkeypatch.setattr(KVCache, "_grow", counted)
    prompts = _prompts(n=60, doc=300) if mode == "parallel" else _prompts(n=4, doc=600)
    answers = generate(model, prompts, SamplingParams(max_new_tokens=3, ignore_eos=True), mode=mode)
    assert len(grown) == (1 if mode == "parallel" else len(prompts))  # one cache per independent question
    assert all(len(a.token_ids) == 3 for a in answers)


def _rows(q, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(q, vocab, generator=g)
    params = (torch.rand(q, generator=g).double() * 1.5 + 0.1, torch.randint(0, 6, (q,), generator=g),
              torch.rand(q, generator=g).double() * 0.9 + 0.1, torch.randint(0, 2**62, (q,), generator=g),
              torch.randint(0, 50, (q,), generator=g))
    return logits, params


@pytest.mark.parametrize("vocab", [61, 1000])
def test_a_rows_draw_does_not_depend_on_the_rows_beside_it(vocab):
    logits, params = _rows(37, vocab, 0)
    together = sample_rows(logits, *params)
    alone = torch.cat([sample_rows(logits[i:i + 1], *(p[i:i + 1] for p in params)) for i in range(37)])
    assert torch.equal(together, alone)
    noise = uniforms(params[3], params[4], 128)
    assert torch.equal(noise[5:9], uniforms(params[3][5:9], params[4][5:9], 128))
    assert bool(((noise > 0) & (noise < 1)).all())
    # negative control: the draws are what decides, so another draw number picks other tokens somewhere
    assert not torch.equal(together, sample_rows(logits, *params[:4], params[4] + 1))


@pytest.mark.parametrize("threads", [1, 2, 3, 6, 8])
def test_the_noise_in_chunks_is_the_formulas_to_the_bit(threads):
    """A CPU computes the Gumbel noise a chunk of columns at a time, in place (sampling.gumbel): every row's
    noise is -log(-log(uniforms)) taken at once at one thread, to the bit, at every thread count (threads past
    this machine's cores cut the work as a bigger machine does), whether the vocabulary fits in one chunk or
    spans many (a chunk holds 128K words: 2,048 columns of 64 rows), for any number of rows, and 0 in the
    padding rows."""
    saved = torch.get_num_threads()
    g = torch.Generator().manual_seed(threads)
    cases = [(q, width, torch.randint(-2**63, 2**63 - 1, (q,), generator=g, dtype=torch.int64),
              torch.randint(0, 2**40, (q,), generator=g))
             for q, width in [(0, 64), (1, 64), (3, 1024), (8, 49152), (37, 8192), (64, 49152), (200, 1920)]]
    try:
        torch.set_num_threads(1)
        formula = [-torch.log(-torch.log(uniforms(keys, steps, width))) for _, width, keys, steps in cases]
        torch.set_num_threads(threads)
        for (q, width, keys, steps), expected in zip(cases, formula):
            noise = gumbel(keys, steps, width, q + 5)
            assert noise.shape == (q + 5, width) and not noise[q:].any()
            assert torch.equal(noise[:q], expected), (q, width)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("width", [64, 1024, 49152])
def test_rows_sorted_by_their_integer_keys_are_torchs_stable_sort(width):
    """A CPU sorts top-k and top-p's rows as integer keys (sampling.sorted_rows), by radix where torch can: the
    values and order of torch's stable descending sort of the floats, ties (0.0 and -0.0 among them) in column
    order, -inf (the padding columns) last; rows left unsorted (here the padding rows, 0 throughout) stay put."""
    g = torch.Generator().manual_seed(width)
    y = torch.randn(9, width, generator=g, dtype=torch.float64).round(decimals=1)  # many ties
    y[:, -5:] = float("-inf")
    y[0, :6] = torch.tensor([-0.0, 0.0, -0.0, 0.0, 4.9e-324, -4.9e-324], dtype=torch.float64)
    y[1] = -y[1].abs()
    want = torch.sort(y, dim=-1, descending=True, stable=True)
    padded = sorted_rows(torch.cat([y[:6], y.new_zeros(3, width)]), range(6))
    for got in (sorted_rows(y), padded):
        assert torch.equal(got[1][:6], want.indices[:6]) and torch.equal(got[0][:6], want.values[:6])
    assert torch.equal(padded[1][6:], torch.arange(width).expand(3, width)) and not padded[0][6:].any()


def test_sampling_ships_tokens_not_vocabulary_rows(model, monkeypatch):
    copies = []
    to_host = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return to_host(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=3, temperature=0.9, top_k=20, top_p=0.8, ignore_eos=True)
    generate(model, prompts, params)
    vocab = model.config.vocab_size
    assert copies and not any(vocab in shape for shape in copies)  # tokens, log-probs and flags only
    copies.clear()  # negative control: keeping every step's logits does ship vocabulary rows, and is seen
    generate(model, prompts, SamplingParams(**{**params.__dict__, "keep_logits": True}))
    assert any(vocab in shape for shape in copies)


def test_a_row_that_filters_nothing_draws_alike_beside_rows_that_do():
    """top_k 0 and top_p 1 are off whatever a running sum rounds to: such a row draws the same token whether
    its neighbours filter (the sorted path) or not (the path that skips the sort)."""
    logits, (t, k, p, keys, steps) = _rows(16, 1000, 1)
    off_k, off_p = torch.zeros_like(k), torch.ones_like(p)
    assert torch.equal(sample_rows(logits, t, off_k, off_p, keys, steps, filtered=True),
                       sample_rows(logits, t, off_k, off_p, keys, steps, filtered=False))


def _whole_rows(logits, t, k, p, keys, steps):
    """sample_rows' tokens as a GPU draws them: every row (whole tiles of 8) through one chain, all sorted."""
    q, vocab = logits.shape
    rows, width = -(-q // 8) * 8, -(-vocab // 64) * 64
    x = torch.full((rows, width), float("-inf"), dtype=torch.float64)
    x[:q, :vocab], x[q:] = logits, 0.0
    y = (x - x.amax(dim=-1, keepdim=True)) / torch.nn.functional.pad(t.double(), (0, rows - q), value=1.0)[:, None]
    g = -torch.log(-torch.log(uniforms(keys, steps, width)))
    g = torch.cat([g, g.new_zeros(rows - q, width)])
    top_k = torch.nn.functional.pad(k, (0, rows - q))[:, None]
    top_p = torch.nn.functional.pad(p.double(), (0, rows - q), value=1.0)[:, None]
    s, order = torch.sort(y, dim=-1, descending=True, stable=True)
    cut = (top_k > 0) & (s < s.gather(1, top_k.clamp(1, vocab) - 1))
    probs = torch.softmax(s.masked_fill(cut, float("-inf")), dim=-1)
    cum = torch.cat([torch.cumsum(probs[i:i + 8], dim=-1) for i in range(0, rows, 8)])
    cut |= (top_p < 1) & (cum - probs >= top_p)
    hidden = torch.zeros_like(cut).scatter_(1, order, cut)
    return torch.argmax(y.masked_fill(hidden, float("-inf")) + g, dim=-1)[:q]


@pytest.mark.parametrize("q", [1, 8, 13, 64])
def test_a_cpus_tiles_of_eight_rows_draw_what_whole_rows_do(q):
    """A CPU takes top-k and top-p a tile of 8 rows at a time, sorting only the rows that filter (a tile where
    none does takes its argmax at once): every row draws the token of the whole-row formula, a GPU's way, for
    rows that filter by top-k, top-p, both or neither, in any mix across tiles, with ties among the logits."""
    logits, (t, k, p, keys, steps) = _rows(q, 1000, q)
    logits[::3] = logits[::3].round()  # ties: the sort's order among equal values decides
    g = torch.Generator().manual_seed(q + 1)
    k = k * (torch.rand(q, generator=g) < 0.5)
    p = torch.where(torch.rand(q, generator=g) < 0.5, p, torch.ones_like(p))
    if q >= 13:
        k[:8], p[:8] = 0, 1.0  # a whole tile that filters nothing
    filters = [bool(a > 0 or b < 1) for a, b in zip(k.tolist(), p.tolist())]
    want = _whole_rows(logits, t, k, p, keys, steps)
    for filtered in (True, filters):
        assert torch.equal(sample_rows(logits, t, k, p, keys, steps, filtered=filtered), want)


def test_a_cpu_sorts_only_the_rows_that_filter():
    """Told which rows filter (`filtered` as a list: `tokens.choose_tokens` names the sampled rows that ask
    for top-k or top-p), a CPU sorts those alone: every row that filters draws what it draws with all rows
    sorted, and so does every row that filters nothing."""
    logits, (t, k, p, keys, steps) = _rows(24, 1000, 2)
    filters = [bool(i % 3) for i in range(24)]
    k, p = k * torch.tensor(filters), torch.where(torch.tensor(filters), p, torch.ones_like(p))
    for step in range(6):
        assert torch.equal(sample_rows(logits, t, k, p, keys, steps + step, filtered=filters),
                           sample_rows(logits, t, k, p, keys, steps + step, filtered=True))
    assert torch.equal(sample_rows(logits, t, k, p, keys, steps, filtered=[False] * 24),
                       sample_rows(logits, t, k, p, keys, steps, filtered=False))
    # negative control: a row that filters but is left unsorted draws from its whole row, other tokens
    unsorted = [f and i != 1 for i, f in enumerate(filters)]
    assert any(not torch.equal(sample_rows(logits, t, k, p, keys, steps + s, filtered=unsorted)[1],
                               sample_rows(logits, t, k, p, keys, steps + s, filtered=True)[1]) for s in range(20))


def _rows_per_pass(model, monkeypatch) -> list[int]:
    """The token rows of every forward pass the model runs from now on (its host half's calls)."""
    rows, lay_out = [], model.lay_out
    monkeypatch.setattr(model, "lay_out", lambda cache, tokens, *a, **k: rows.append(tokens.shape[0]) or
                        lay_out(cache, tokens, *a, **k))
    return rows


@pytest.mark.parametrize("mode, layout", [("parallel", {}), ("parallel", {"parallel_size": 2}),
                                          ("independent", {})])
@pytest.mark.parametrize("sampled", [False, True])
def test_decoding_ahead_of_the_host_gives_the_same_answers(monkeypatch, mode, layout, sampled):
    """A decode step launched before the step before is read (`Steps.overlap`, a GPU's default) gives every
    answer the same tokens, log-probs, logits and finish reason, and the same streaming callbacks and stats:
    questions stopped by a stop rule (a callback, a stop id), by their length, and by the context, greedy and
    sampled. A question a stop rule ends (at its prefill or a decode step) has run one row more, dropped
    unread; one that ends by its length or the context never does."""
    model = tiny_model(tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8, max_pos=140), seed=5)
    prompts = _prompts(n=6)
    free = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.8 * sampled, seed=3)
    full = generate(model, prompts, free)  # each question's own stream: its tokens until a stop rule ends it
    targets = [a.token_ids[:n] for a, n in zip(full, [1, 2, 5, 9, 12, 12])]
    prompts[5] = prompts[5][:2] + [7] * (model.config.max_position_embeddings - 8)  # the context ends it
    params = dataclasses.replace(free, keep_logits=True, stop=lambda ids: ids in targets,
                                 stop_token_ids=(full[1].token_ids[6],))
    runs = []
    for ahead in (False, True):
        model.steps.overlap = ahead
        counts, finished, stats = [], [], Stats()
        rows = _rows_per_pass(model, monkeypatch)
        answers = generate(model, prompts, params, mode=mode, on_token=counts.append, stats=stats,
                           on_answer=lambda i, a: finished.append(i), **layout)
        runs.append((answers, counts, sorted(finished), stats.generated_tokens, sum(rows)))
    model.steps.overlap = None
    (before, counts, finished, generated, rows), (after, *rest) = runs
    assert_same_answers(before, after)
    assert (counts, finished, generated) == tuple(rest[:3])
    by_rule = sum(a.finish_reason == "stop" and len(a.token_ids) < params.max_new_tokens for a in before)
    assert by_rule >= 3 and any(a.finish_reason == "length" for a in before)
    assert rest[3] == rows + by_rule  # one dropped row per question a stop rule ended before its last token


def test_decoding_ahead_reads_each_step_once_the_next_is_launched(model, monkeypatch):
    """Ahead of the host, step t's tokens are read after step t + 1 is launched (the host plans a step while
    the device computes the one before), the prefill's first tokens after the first decode step; without it,
    each step is read before the next. A question of 4 tokens: its document's prefill and its own, then 3
    decode steps, the last known to be the last by its length."""
    events, record, run_step = [], tokens_module.Chosen.record, model.run_step
    monkeypatch.setattr(tokens_module.Chosen, "record",
                        lambda self, *a, **k: events.append("read") or record(self, *a, **k))
    monkeypatch.setattr(model, "run_step", lambda *a: events.append("run") or run_step(*a))
    monkeypatch.setattr(model.steps, "captured", False)  # eager: a replayed graph does not call run_step
    orders = []
    for ahead in (True, False):
        model.steps.overlap = ahead
        events.clear()
        generate(model, _prompts(n=1), SamplingParams(max_new_tokens=4, ignore_eos=True))
        orders.append(list(events))
    model.steps.overlap = None
    assert orders[0] == ["run", "run", "run", "read", "run", "read", "run", "read", "read"]
    assert orders[1] == ["run"] + ["run", "read"] * 4


class Waited:
    """A stand-in CUDA event: counts the host's waits on it."""

    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def unwaited_copies(monkeypatch) -> tuple[list[torch.Size], list[Waited]]:
    """The GPU's way of moving data (transfer.py), taken on a CPU: copies from stand-in pinned memory (which
    the device's copy back fills with -1 until it runs) and stand-in events. Returns (the shapes pinned, the
    events made), filled as they come."""
    pinned, events = [], []
    monkeypatch.setattr(transfer, "UNWAITED", {"cuda", "cpu"})
    monkeypatch.setattr(transfer, "pin", lambda t: pinned.append(t.shape) or t.clone())
    monkeypatch.setattr(transfer, "pinned_like", lambda t: torch.full(t.shape, -1, dtype=t.dtype))
    monkeypatch.setattr(transfer, "recorded_event", lambda device: events.append(Waited()) or events[-1])
    return pinned, events


def test_the_unwaited_copies_give_the_same_answers(model, monkeypatch):
    """The GPU's way of moving data (transfer.py: pinned copies that do not wait, tokens read back into pinned
    memory behind an event), taken on a CPU with stand-ins for pinned memory and CUDA events, decoding ahead
    of the host: the answers of plain copies, and every step's event waited on exactly once."""
    prompts = _prompts(n=4)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, keep_logits=True, temperature=0.9, seed=4,
                            stop=lambda ids: len(ids) == 1 + ids[0] % 6)
    plain = generate(model, prompts, params)

    pinned, events = unwaited_copies(monkeypatch)
    model.steps.overlap = True
    try:
        ahead = generate(model, prompts, params)
    finally:
        model.steps.overlap = None
    assert_same_answers(plain, ahead)
    assert pinned and len(events) >= 6 and all(e.waited == 1 for e in events)


@pytest.mark.parametrize("mode", ["parallel", "independent", "seqbatch"])
def test_the_kernel_switches_refuse_to_change_under_a_call(model, mode):
    """Calls on one model from several threads give each answer its solo bits; a switch that chooses the
    kernels (`model.invariant`, `model.units`), set by another thread or a callback while a call answers, raises
    RuntimeError rather than give that answer some steps of each kind (it gave mixed answers, solo of neither)."""
    prompts, params = _prompts(n=3), SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=2,
                                                              keep_logits=True)
    solo = generate(model, prompts, params, mode=mode)
    started, go_on, refused = threading.Event(), threading.Event(), []

    def waits(_):
        started.set()
        go_on.wait(60)

    def flips(_):
        with pytest.raises(RuntimeError, match="model.invariant cannot change while generate"):
            model.invariant = False

    answers = {}
    threads = [threading.Thread(target=lambda: answers.update(a=generate(model, prompts, params, mode=mode,
                                                                         on_token=waits))),
               threading.Thread(target=lambda: answers.update(b=generate(model, prompts, params, mode=mode)))]
    for t in threads:
        t.start()
    assert started.wait(60)
    for name, value in (("invariant", False), ("units", 2)):
        try:
            setattr(model, name, value)
        except RuntimeError as e:
            refused.append(str(e))
    go_on.set()
    for t in threads:
        t.join(120)
    assert len(refused) == 2 and "model.units cannot change" in refused[1]
    assert model.invariant and model.units == 1
    assert_same_answers(solo, answers["a"])
    assert_same_answers(solo, answers["b"])
    assert_same_answers(solo, generate(model, prompts, params, mode=mode, on_token=flips))  # its own callback
    model.invariant = False  # between calls: as before
    model.invariant = True




def test_compiled_steps_refuse_to_switch_under_a_call(model):
    """`model.steps.compiled` chooses the kernels as `model.invariant` does (compiled bits are not eager bits): set
    by a callback or another thread while a call answers, it raises RuntimeError. It took effect at the next pass,
    and the answer's later logits were compiled ones after eager ones: the solo bits of neither."""
    prompts, params = _prompts(n=2), SamplingParams(max_new_tokens=4, ignore_eos=True, keep_logits=True)
    solo, refused = generate(model, prompts, params), []

    def flips(_):
        try:
            model.steps.compiled = True
        except RuntimeError as e:
            refused.append(str(e))

    assert_same_answers(solo, generate(model, prompts, params, on_token=flips))
    assert refused and all("model.steps.compiled cannot change while generate" in r for r in refused)
    assert not model.steps.compiled
    model.steps.compiled = True  # between calls: as before
    model.steps.compiled = False

def test_an_interrupt_anywhere_in_a_call_leaves_no_call_under_way(model):
    """A Ctrl-C (KeyboardInterrupt, raised between bytecodes wherever it lands) that ends a call at any point,
    the bookkeeping of `Steps.answering` included, leaves the model as it was: no call under way, so the kernel
    switches change, and the next call answers the same bits. A count raised on entering a call and lowered in a
    context manager's exit stayed raised after about one in 250 interrupts (every later `model.units = 2` refused)."""
    prompts = _prompts(n=2)
    params, nothing = SamplingParams(max_new_tokens=3, keep_logits=True), SamplingParams(max_new_tokens=0)
    before = generate(model, prompts, params)
    armed, interrupted, rng = [], 0, random.Random(0)

    def interrupt(signum, frame):
        if armed:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        start = time.perf_counter()
        for _ in range(20):
            generate(model, prompts, nothing)  # a call of bookkeeping alone: the interrupts land there often
        call_s = (time.perf_counter() - start) / 20
        for _ in range(4000):
            try:
                armed.append(True)
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.1 * call_s, 1.2 * call_s))
                generate(model, prompts, nothing)
                signal.setitimer(signal.ITIMER_REAL, 0)
                armed.clear()
            except KeyboardInterrupt:
                interrupted += 1
            armed.clear()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert interrupted > 400, interrupted  # most calls were cut short somewhere
    model.units = 2  # refused ("cannot change while generate() ... is answering") where a call was left under way
    model.units = 1
    assert_same_answers(before, generate(model, prompts, params))

def test_a_sampled_row_of_logits_with_plus_inf_is_refused_as_nan_is():
    """A row holding +inf (float16 logits past its range) has no distribution to sample from (its softmax is NaN),
    yet a sampled question picked its first +inf token without a word, with a NaN log-prob; now it is refused in
    one line, as a row of NaN is. A greedy question takes the first +inf, the argmax, as before."""
    from minillama.errors import BadInput

    logits = torch.tensor([[0.0, float("inf"), 1.0, float("inf")]] * 2)
    greedy = tokens_module.Question(0, SamplingParams(max_new_tokens=4), eos=set())
    tokens_module.take_tokens([greedy], logits[:1], max_positions=100)
    assert greedy.answer.token_ids == [1]
    for bad in (float("inf"), float("nan")):
        row = torch.tensor([[0.0, bad, 1.0, 2.0]])
        sampled = tokens_module.Question(0, SamplingParams(max_new_tokens=4, temperature=0.7, seed=1), eos=set())
        with pytest.raises(BadInput, match=r"^the model's logits hold NaN or \+inf: there is nothing to sample from"):
            tokens_module.take_tokens([sampled], row, max_positions=100)
    fine = tokens_module.Question(0, SamplingParams(max_new_tokens=4, temperature=0.7, seed=1), eos=set())
    tokens_module.take_tokens([fine], torch.tensor([[0.0, float("-inf"), 1.0, 2.0]]), max_positions=100)  # -inf: never
    assert fine.answer.token_ids[0] != 1
