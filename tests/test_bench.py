"""The benchmark harness on a tiny random model: the task, the cost model, the records and files it
writes, and that parallel (and batched) answers are the independent ones. Timings are never asserted."""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minillama.bench import (METHODS, TINY_SHAPE, Case, CostModel, TaskConfig, WordTokenizer, findings, make_task,
                             plain_prompt_ids, run, setup, write_outputs)
from minillama.bench.runner import _flops

ROOT = Path(__file__).resolve().parent.parent
TASK = TaskConfig(doc_tokens=40, n_docs=2, questions_per_doc=3, question_tokens=8, new_tokens=3)
MINILLAMA = ("independent", "independent_plain", "batched", "seqbatch", "parallel")


@pytest.fixture
def one_thread():
    # The tiny model's ops are microseconds long: a second thread only adds synchronisation.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def test_task_asks_about_facts_in_its_document():
    tok = WordTokenizer(TINY_SHAPE.vocab_size)
    task = make_task(tok, TaskConfig(doc_tokens=200, n_docs=2, questions_per_doc=10), plain_prompt_ids(tok))
    assert task.n == 20 and task.docs == [0] * 10 + [1] * 10
    assert len(set(map(tuple, task.prompts))) == 20  # repeated facts are asked in distinct words
    for q, d, color in zip(task.questions, task.docs, task.colors):
        part, animal, name = q.split("What color is the ")[1].rstrip("?").replace(" of the ", "|") \
            .replace(" named ", "|").split("|")
        assert f"The {animal} named {name} has {part} that" in task.doc_texts[d]
        assert f"{part} that is {color}." in task.doc_texts[d] or f"{part} that are {color}." in task.doc_texts[d]
    assert all(len(p) > 200 for p in task.prompts)


def test_cost_model_counts_the_document_once_in_parallel():
    cost = CostModel(TINY_SHAPE)
    doc, g = list(range(50)), 4
    prompts = [doc + [7, 8, 9], doc + [5, 6]]
    par = cost.parallel(prompts, [0, 0], g)
    assert par["total"] == pytest.approx(par["prefill"] + par["decode"])
    assert par["total"] < cost.independent(prompts, g)
    one = cost.parallel(prompts[:1], [0], g)["total"]  # a lone prompt: no sharing, the same work
    assert one == pytest.approx(cost.independent(prompts[:1], g))
    assert cost.span(0, 3) == pytest.approx(cost.layers * (3 * cost.linear + 6 * cost.attn_per_key))


def test_each_method_is_charged_its_own_work():
    tok = WordTokenizer(TINY_SHAPE.vocab_size)
    task = make_task(tok, TaskConfig(doc_tokens=60, n_docs=2, questions_per_doc=4), plain_prompt_ids(tok))
    cost, idx = CostModel(TINY_SHAPE), list(range(task.n))
    flops = {m: _flops(cost, m, task, idx) for m in METHODS}
    # Plain kernels do the same arithmetic as the invariant ones: the same FLOPs, not another method's.
    assert flops["parallel_plain"] == flops["parallel"]
    assert flops["independent_plain"] == flops["independent"]
    # Parallel is the least work; the prefix-cache peer pads its questions, so it does more.
    assert flops["parallel"] == min(flops.values()) and flops["hf_prefix"] > flops["parallel"]
    with pytest.raises(ValueError, match="no cost model"):
        _flops(cost, "telepathy", task, idx)


def test_harness_records_files_and_parity(tmp_path, one_thread):
    ctx = setup(None, TINY_SHAPE, hf=False, workdir=tmp_path)
    # independent runs once, in two slices of questions; batched once, whole; the others twice.
    cases = [Case("headline", TASK, MINILLAMA, once=("independent", "batched"), label="tiny"),
             Case("grid", TASK, ("parallel",), parallel_size=2, batch_docs=1, label="batch=1 parallel=2"),
             # The same prompts, longer answers: checked against their own independent run, not the above.
             Case("answer", dataclasses.replace(TASK, new_tokens=5), ("independent", "parallel"), label="5 tokens")]
    records, gemm = run(cases, ctx, repeats=2, log=lambda s: None)
    assert gemm and all(x > 0 for x in gemm)
    by = {(r["sweep"], r["method"]): r for r in records}
    assert set(by) == ({("headline", m) for m in MINILLAMA} | {("grid", "parallel")}
                       | {("answer", "independent"), ("answer", "parallel")})
    assert [by[("headline", m)]["repeats"] for m in MINILLAMA] == [1, 2, 1, 2, 2]
    for r in records:
        assert r["questions"] == 6 and r["generated_tokens"] == 6 * r["new_tokens"]
        assert r["wall_s"] == pytest.approx(r["prefill_s"] + r["decode_s"])
        assert r["kv_bytes"] > 0 and r["flops_useful"] > 0 and 0 <= r["accuracy"] <= 1
        assert r["checked_against_independent"] == 6
    # The claim: every parallel answer is the independent one, token for token, whatever the grouping;
    # so are the batched ones (each prompt alone in its own segment).
    for key in (("headline", "parallel"), ("grid", "parallel"), ("headline", "batched"), ("answer", "independent"),
                ("answer", "parallel")):
        assert by[key]["identical_to_independent"] == 6, key
    par, bat = by[("headline", "parallel")], by[("headline", "batched")]
    assert par["kv_bytes"] < bat["kv_bytes"]  # the document stored once, not once per question
    assert par["flops_executed"] == pytest.approx(par["flops_useful"])
    assert par["decode_steps"] == TASK.new_tokens - 1 and by[("grid", "parallel")]["decode_steps"] == 4 * 2
    assert "prefill_frac_of_gemm" in par and par["decode_flops_per_step"] > 0

    paths = write_outputs(tmp_path, records, {"preset": "test", "model": "tiny", "gemm_gflops": gemm[0],
                                              "threads": 1})
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["records"]) == len(records) and "parallel_speedup_vs_independent_plain" in data["findings"]
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(records)
    assert "| parallel |" in (tmp_path / "summary.md").read_text()
    assert {p.name for p in paths} >= {"headline.png", "grid.png"} and all(p.stat().st_size > 0 for p in paths)


def test_hf_methods_run_on_the_same_prompts(tmp_path, one_thread):
    pytest.importorskip("transformers")
    ctx = setup(None, TINY_SHAPE, hf=True, workdir=tmp_path)
    task = TaskConfig(doc_tokens=30, n_docs=1, questions_per_doc=3, question_tokens=8, new_tokens=3)
    records, _ = run([Case("headline", task, ("independent", "hf_batched", "hf_prefix"))], ctx, repeats=1,
                     log=lambda s: None)
    for r in records:
        assert r["checked_against_independent"] == 3 and r["kv_bytes"] > 0 and r["wall_s"] > 0
        # Another implementation: the same tokens are expected on this tiny model, not its bits.
        assert r["identical_to_independent"] >= 2, r["method"]


def test_readme_table_is_regenerated_between_its_markers(tmp_path):
    from minillama.bench import main
    from minillama.bench.report import README_END, README_START, readme_table

    results = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    table = readme_table(results)
    # What was scaled is said, row by row and in the caption; the identity column says tokens, the bits apart.
    par = next(line for line in table.splitlines() if line.startswith("| **parallel**"))
    assert "| 64 |" in par and "same bits" in par
    for method in ("batched", "seqbatch", "hf_batched", "independent_plain"):
        rec = next(r for r in results["records"] if r["sweep"] == "headline" and r["method"] == method)
        assert rec["extrapolated"] and f"{method} ({rec['measured_questions']} of 64)" in table
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nstale table\n{README_END}\nrest\n")
    assert main(["--from-json", str(ROOT / "docs/bench/results.json"), "--readme", str(readme),
                 "--out", str(tmp_path / "out")]) == 0
    assert readme.read_text() == f"intro\n{README_START}\n{table}\n{README_END}\nrest\n"
    readme.write_text("no markers here\n")
    assert main(["--from-json", str(ROOT / "docs/bench/results.json"), "--readme", str(readme),
                 "--out", str(tmp_path / "out")]) == 2
    assert readme.read_text() == "no markers here\n"  # nothing the user gave is lost


def test_readme_table_shows_the_targets_a_run_measured():
    from minillama.bench.report import readme_table

    results = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    # A run without llama.cpp (no record, no finding) says nothing about it.
    results["records"] = [r for r in results["records"] if r["method"] != "llamacpp"]
    results["findings"] = {k: v for k, v in results["findings"].items() if "llamacpp" not in k}
    assert "llama.cpp" not in readme_table(results)
    results["findings"]["parallel_speedup_vs_llamacpp"] = 1.2
    row = next(line for line in readme_table(results).splitlines() if "llama.cpp" in line)
    assert row.endswith("| 1.200 | missed |")


def test_shape_bench_runs_on_cpu_against_its_roofline(tmp_path, one_thread):
    from minillama.bench import main

    assert main(["--shape", "tiny", "--tiny", "--tables", "--repeats", "1", "--sample", "2",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "shape_results.json").read_text())
    assert data["meta"]["gemm_tflops"] > 0 and data["meta"]["bandwidth_gbs"] > 0
    assert data["meta"]["products"] == "native"  # float32: no cast, on any device
    head = {r["method"]: r for r in data["records"] if r["label"] == "headline"}
    assert {"parallel", "parallel_plain", "independent"} <= set(head)
    ind = head["independent"]
    assert ind["questions_run"] == 2 and ind["scaled_by"] == ind["questions"] / 2  # sampled, and said so
    assert ind["same_tokens_as_parallel"] == 2  # the bit-exact reference: parallel answers it exactly
    for r in data["records"]:
        assert r["floor_s"] == pytest.approx(r["floor_gemm_s"] + r["floor_weights_s"]) and r["floor_s"] > 0
        assert r["x_floor"] == pytest.approx(r["wall_s"] / r["floor_s"])
        assert r["tokens_per_s"] == pytest.approx(r["questions"] * r["new_tokens"] / r["wall_s"])
    tables = [r for r in data["records"] if r["label"].startswith("Table")]
    assert len(tables) == 6 and {r["n_docs"] for r in tables} == {1, 8}
    assert "x roofline floor" in (tmp_path / "shape_summary.md").read_text()


def test_shape_bench_says_which_16bit_path_it_took(tmp_path, one_thread, monkeypatch):
    from minillama.bench import main

    monkeypatch.setenv("MINILLAMA_CPU_16BIT", "float32")  # the path of a CPU without 16-bit dot products
    assert main(["--shape", "tiny", "--tiny", "--dtype", "float16", "--repeats", "1", "--sample", "2", "--no-hf",
                 "--compare-dtypes", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "shape_results.json").read_text())
    products = data["meta"]["products"]
    assert products == "float32 products on float16 storage (MINILLAMA_CPU_16BIT=float32)"
    summary = (tmp_path / "shape_summary.md").read_text()
    assert products in summary
    by_dtype = {r["dtype"]: r for r in data["dtypes"]}  # --compare-dtypes: each dtype beside float32
    assert set(by_dtype) == {"float32", "bfloat16", "float16"} and by_dtype["float32"]["x_float32"] == 1.0
    assert by_dtype["bfloat16"]["products"] == "float32 products on bfloat16 storage (MINILLAMA_CPU_16BIT=float32)"
    for r in by_dtype.values():
        assert r["x_float32"] == pytest.approx(r["wall_s"] / by_dtype["float32"]["wall_s"])
        assert f"| {r['dtype']} | {r['products']} |" in summary
    assert main(["--shape", "tiny", "--compare-dtypes", "--tp", "2"]) == 2  # one process only


def test_roofline_floor_arithmetic():
    from minillama.bench.device import floor_s

    prompts, docs = [[5] * 10 + [6, 7], [5] * 10 + [8]], [0, 0]
    f = floor_s(TINY_SHAPE, prompts, docs, 4, weight_bytes=10**9, tflops=2.0, gbs=100.0)
    assert f["floor_weights_s"] == pytest.approx(3 * 10**9 / 100e9)  # 3 decode steps, every weight read once
    assert f["floor_gemm_s"] == pytest.approx(CostModel(TINY_SHAPE).parallel(prompts, docs, 4)["prefill"] / 2e12)


def test_shape_bench_refuses_a_missing_device(capsys):
    from minillama.bench import main

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert main(["--shape", "tiny", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# llama.cpp as a peer: the F32 GGUF of the same weights, and the method on it

sys.path.insert(0, str(ROOT / "tests"))
from _ckpt_writers import (byte_bpe_tokenizer, gguf_tokenizer_metadata, random_state_dict,  # noqa: E402
                           tiny_config, write_gguf, write_hf_dir)
from _ckpt_writers import half_to_interleaved as reference_half_to_interleaved  # noqa: E402


@pytest.fixture(scope="module")
def bpe():
    return byte_bpe_tokenizer()


def _hf_tokenizer(bpe):
    from _ckpt_writers import CHATML

    from minillama.tokenizer import HFTokenizer

    return HFTokenizer(bpe, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=CHATML)


@pytest.mark.parametrize("tied, llama3", [(True, False), (False, True)])
def test_f32_gguf_holds_the_hf_directory_tensors(tmp_path, bpe, tied, llama3):
    """Written from an HF directory, read back by gguf's own reader and by minillama's: the same tensors,
    F32, GGUF names, Q/K rows in GGUF's interleaved order, the tokenizer copied from the source GGUF."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf import GGMLQuantizationType as Q

    from minillama.bench.gguf_f32 import tokenizer_fields, write_f32_gguf
    from minillama.weights import (GGUF_NAMES, expected_shapes, llama3_rope_factors, load_state_dict, load_tokenizer,
                                   read_gguf)

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192} if llama3 else None
    # head dim 64: enough RoPE frequencies for Llama 3's scaling to be read back from its factors
    config = tiny_config(vocab=320, hidden=256, ffn=256, tied=tied, rope_scaling=scaling,
                         rope_theta=500000.0 if llama3 else 10000.0)
    hf_dir = write_hf_dir(tmp_path / "hf", config, random_state_dict(config, seed=3), _hf_tokenizer(bpe))
    source = write_gguf(tmp_path / "q8.gguf", config, random_state_dict(config, seed=4), gguf_tokenizer_metadata(bpe),
                        Q.Q8_0)  # another checkpoint of the same model: only its tokenizer is taken
    c, sd = load_state_dict(hf_dir)
    path = write_f32_gguf(c, sd, tmp_path / "m.f32.gguf", tokenizer_from=source)

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == GGMLQuantizationType.F32 for t in reader.tensors)
    want = expected_shapes(c)  # a plain Llama: none of the family's biases or norms
    expected = {g.replace("{i}", str(i)) for g, hf in GGUF_NAMES.items() if hf is not None and "{i}" in g
                for i in range(c.num_hidden_layers) if hf.format(i=i) in want} | {"token_embd.weight", "output_norm.weight"}
    expected |= set() if tied else {"output.weight"}
    expected |= {"rope_freqs.weight"} if llama3 else set()
    assert set(tensors) == expected
    raw = lambda name: torch.from_numpy(tensors[name].data.copy()).reshape(  # noqa: E731
        tuple(int(n) for n in reversed(tensors[name].shape.tolist())))
    # GGUF's own order, checked against the tests' independent writer of that order
    q, k = sd["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(raw("blk.1.attn_q.weight"), reference_half_to_interleaved(q, c.num_attention_heads))
    assert torch.equal(raw("blk.1.attn_k.weight"), reference_half_to_interleaved(k, c.num_key_value_heads))
    assert torch.equal(raw("blk.0.ffn_down.weight"), sd["model.layers.0.mlp.down_proj.weight"])
    if llama3:
        assert np.array_equal(tensors["rope_freqs.weight"].data,
                              llama3_rope_factors(scaling, c.head_dim, c.rope_theta).astype(np.float32))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == c.num_hidden_layers
    assert {k: v for k, v, *_ in tokenizer_fields(path)} == {k: v for k, v, *_ in tokenizer_fields(source)}

    back, back_sd, _ = read_gguf(path)  # minillama's reader: the HF directory's tensors, bit for bit
    assert set(back_sd) == set(sd)
    for name, t in sd.items():
        assert torch.equal(back_sd[name], t), name
    assert back.tie_word_embeddings == tied and back.num_key_value_heads == c.num_key_value_heads
    assert (back.rope_scaling is not None) == llama3
    text = "The fox named Max has ears that are red. 12 + 34"
    assert load_tokenizer(path).encode(text) == load_tokenizer(hf_dir).encode(text)


def test_f32_gguf_is_cached_beside_its_checkpoint(tmp_path, bpe):
    import os

    from gguf import GGUFReader

    from minillama.bench.gguf_f32 import f32_gguf

    config = tiny_config(vocab=320)
    hf_dir = write_hf_dir(tmp_path / "model", config, random_state_dict(config), _hf_tokenizer(bpe))
    path = f32_gguf(hf_dir)
    assert path == tmp_path / "model.f32.gguf"
    # no GGUF to copy a tokenizer from: llama.cpp's model without a vocabulary (it is given token ids)
    assert GGUFReader(str(path)).fields["tokenizer.ggml.model"].contents() == "no_vocab"
    before = path.stat().st_mtime_ns
    assert f32_gguf(hf_dir) == path and path.stat().st_mtime_ns == before  # reused
    st = (hf_dir / "model.safetensors").stat()
    os.utime(hf_dir / "model.safetensors", (st.st_atime, before / 1e9 + 10))  # the checkpoint changed
    f32_gguf(hf_dir)
    assert path.stat().st_mtime_ns != before


def _llamacpp_logits(path, ids: list[int]) -> np.ndarray:
    from minillama.bench.llamacpp import Model, Session

    s = Session(Model(path), n_ctx=len(ids) + 64, n_batch=len(ids), n_seq=1, threads=1)
    try:
        s.decode([(t, i, 0, True) for i, t in enumerate(ids)])
        return np.stack([s.logits(i).copy() for i in range(len(ids))])
    finally:
        s.close()


@pytest.mark.parametrize("tied, llama3", [(True, False), (False, True)])
def test_llamacpp_computes_minillama_logits_from_the_f32_gguf(tmp_path, one_thread, monkeypatch, tied, llama3):
    """The file is the same model to llama.cpp: its logits are minillama's up to its F16 KV cache. The
    negative control writes Q/K rows in minillama's own order: llama.cpp then computes another model."""
    pytest.importorskip("llama_cpp")
    import minillama.bench.gguf_f32 as gguf_f32

    from tiny import tiny_config as model_config
    from tiny import tiny_model

    config = model_config(head_dim=16, tied=tied, llama3=llama3)
    model = tiny_model(config)
    ids = torch.randint(3, config.vocab_size, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache()
    seg = cache.new_segment()
    with torch.inference_mode():
        ref = model(torch.tensor(ids), torch.arange(len(ids)), torch.full((len(ids),), seg), cache).numpy()

    def rel_err(path):
        got = _llamacpp_logits(path, ids)
        return np.abs(got - ref).max() / np.abs(ref).max(), (got.argmax(1) == ref.argmax(1)).mean()

    err, same = rel_err(gguf_f32.write_f32_gguf(config, model.state_dict(), tmp_path / "m.gguf"))
    assert err < 5e-3 and same == 1.0
    monkeypatch.setattr(gguf_f32, "half_to_interleaved", lambda w, n: w)
    err, same = rel_err(gguf_f32.write_f32_gguf(config, model.state_dict(), tmp_path / "unpermuted.gguf"))
    assert err > 0.1 and same < 0.9


def test_llamacpp_method_answers_the_same_tokens(tmp_path, one_thread):
    """End to end in the harness: each document's prefix once, every question batched, two documents in
    one pass; the tokens are the independent ones on this tiny model (another program: tokens, not bits)."""
    pytest.importorskip("llama_cpp")
    from tiny import tiny_config as model_config
    from tiny import tiny_model

    from minillama.bench import Context

    # Weights whose logits spread out, so that an answer depends on what the question sees.
    config = model_config(head_dim=16, tied=True, vocab=TINY_SHAPE.vocab_size)
    ctx = Context(tiny_model(config), WordTokenizer(config.vocab_size), None, checkpoint=None, workdir=tmp_path)
    records, _ = run([Case("headline", TASK, ("independent", "parallel", "llamacpp"), label="tiny")], ctx, repeats=2,
                     log=lambda s: None)
    by = {r["method"]: r for r in records}
    lc, par = by["llamacpp"], by["parallel"]
    assert lc["repeats"] == 2 and lc["measured_questions"] == 6 and lc["stable_across_repeats"]
    assert lc["identical_to_independent"] == 6 and lc["identical_to_parallel"] == lc["checked_against_parallel"] == 6
    assert lc["wall_s"] == pytest.approx(lc["prefill_s"] + lc["decode_s"]) and lc["wall_s"] > 0 and lc["setup_s"] > 0
    # one decode for both documents' prefixes, one for all questions' own tokens, then one per new token
    assert lc["forward_passes"] == 1 + TASK.new_tokens and lc["decode_steps"] == TASK.new_tokens - 1
    # the prefixes' cells are stored once: what llama.cpp holds is parallel's token count at F16
    c = config
    tokens = lc["kv_bytes"] / (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2)
    task = make_task(ctx.tokenizer, TASK, plain_prompt_ids(ctx.tokenizer))
    own = sum(len(p) for p in task.prompts) - 3 * 2 * par["doc_tokens_real"]
    assert tokens == 2 * par["doc_tokens_real"] + own + task.n * (TASK.new_tokens - 1)
    assert lc["flops_executed"] == pytest.approx(par["flops_executed"])
    found = findings(records)
    assert found["parallel_speedup_vs_llamacpp"] == pytest.approx(lc["wall_s"] / par["wall_s"])
    assert found["llamacpp_same_tokens_as_parallel"] == "6/6"


def test_bench_command_skips_llamacpp_when_it_is_missing(tmp_path, monkeypatch, capsys, one_thread):
    import minillama.bench.command as command

    monkeypatch.setattr(command, "llamacpp_available", lambda: False)
    assert command.main(["--quick", "--only", "headline", "--repeats", "1", "--no-hf", "--methods",
                         "parallel,llamacpp", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "llama-cpp-python is not installed: skipping the llamacpp method" in err
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"] for r in data["records"]} == {"parallel"}
    assert command.main(["--quick", "--methods", "parallel,telepathy", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: --methods: unknown method(s) telepathy (known: {', '.join(METHODS)})"
    assert command.main(["--quick", "--doc-lengths", "long", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: --doc-lengths: expected comma-separated integers, got 'long'"


def test_a_run_once_method_left_out_of_a_case_is_not_run(tmp_path, one_thread):
    """--methods can drop the long run-once reference from a case; the others still run and are compared."""
    ctx = setup(None, TINY_SHAPE, hf=False, workdir=tmp_path)
    records, _ = run([Case("headline", TASK, ("parallel",), once=("independent",))], ctx, repeats=2,
                     log=lambda s: None)
    assert [r["method"] for r in records] == ["parallel"] and records[0]["checked_against_independent"] == 0
    assert records[0]["identical_to_parallel"] == 6


@pytest.mark.slow
def test_llamacpp_on_the_default_models_f32_gguf_answers_like_minillama():
    """The default model's F32 GGUF (written once, cached under weights/): llama.cpp's greedy tokens are
    minillama's and its logits are within 5e-2 (its KV cache is F16; about 2e-2 is typical)."""
    pytest.importorskip("llama_cpp")
    import minillama
    from minillama.api import prompt_ids
    from minillama.bench.gguf_f32 import f32_gguf
    from minillama.generate import SamplingParams, generate

    llama, tok = minillama.load()
    doc = (ROOT / "examples" / "doc.txt").read_text()
    questions = [q.strip() for q in (ROOT / "examples" / "questions.txt").read_text().splitlines() if q.strip()][:3]
    prompts = [prompt_ids(tok, doc, q) for q in questions]
    answers = generate(llama, prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), mode="parallel")
    path = f32_gguf()
    for p, a in zip(prompts, answers):
        ids = p + a.token_ids
        cache = llama.new_cache()
        seg = cache.new_segment()
        with torch.inference_mode():
            ref = llama(torch.tensor(ids), torch.arange(len(ids)), torch.full((len(ids),), seg), cache)
        ref = ref[len(p) - 1:-1].numpy()
        got = _llamacpp_logits(path, ids)[len(p) - 1:-1]
        assert got.argmax(1).tolist() == a.token_ids
        assert np.abs(got - ref).max() < 5e-2


@pytest.mark.parametrize("shape, params", [("llama3-8b", 8_030_261_248), ("llama3.2-1b", 1_235_814_400),
                                           ("smollm2", 134_515_008), ("smollm2-360m", 361_821_120)])
def test_named_shapes_have_the_published_parameter_counts(shape, params):
    """Each --shape builds the model it names: its parameter count is the published checkpoint's."""
    from minillama.bench.shapes import SHAPES
    from minillama.model import Llama

    with torch.device("meta"):
        model = Llama(SHAPES[shape])
    assert sum(p.numel() for p in model.parameters()) == params
