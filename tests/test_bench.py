"""The benchmark harness on a tiny random model: the task, the cost model, the records and files it
writes, and that parallel (and batched) answers are the independent ones. Timings are never asserted."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path
from unittest import mock

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


def test_the_headline_speedup_column_names_the_method_it_divides_by():
    """Without independent_plain in the run, the column still said "vs independent (plain)" and divided by
    whichever method came first."""
    from minillama.bench.report import headline_table

    def row(method, wall):
        return {"sweep": "headline", "method": method, "extrapolated": False, "wall_s": wall, "prefill_s": 1.0,
                "decode_s": 1.0, "cpu_s": 1.0, "tokens_per_s": 1.0, "kv_bytes": 0, "peak_rss_bytes": 0,
                "accuracy": 1.0, "identical_to_independent": 1, "checked_against_independent": 1,
                "useful_frac_of_gemm": 0.1}

    table = headline_table([row("independent", 8.0), row("parallel", 1.0)])
    assert "| speedup vs independent |" in table
    assert "speedup vs independent (plain)" in headline_table([row("independent_plain", 8.0), row("parallel", 1.0)])


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
    assert "independent ran on a sample of the questions" in (tmp_path / "shape_summary.md").read_text()
    # the bench's own command line, whoever started it (it was this process's: pytest's, or "... bench bench")
    assert data["meta"]["command"] == ("python -m minillama.bench --shape tiny --tiny --tables --repeats 1 --sample 2 "
                                       f"--out {tmp_path}")


def test_shape_bench_sample_0_runs_every_question(tmp_path, one_thread, monkeypatch):
    """--sample 0 is every question, as in the task bench (the shape bench ran 4). A headline of 6 questions
    at --tiny's sizes (it has 4)."""
    import dataclasses

    from minillama.bench import device, main

    monkeypatch.setattr(device, "HEADLINE", dataclasses.replace(device.HEADLINE, questions=6 * 16))

    assert main(["--shape", "tiny", "--tiny", "--repeats", "1", "--sample", "0", "--no-hf",
                 "--out", str(tmp_path)]) == 0
    ind = next(r for r in json.loads((tmp_path / "shape_results.json").read_text())["records"]
               if r["label"] == "headline" and r["method"] == "independent")
    assert ind["questions_run"] == ind["questions"] == 6 and ind["scaled_by"] == 1


def test_shape_bench_parity_check_counts_differing_steps(tmp_path, one_thread):
    """--parity: the invariant kernels give the independent run's logits at every step; the plain ones (the
    check's own negative control) do not, and the report says so."""
    from minillama.bench import main

    assert main(["--shape", "tiny", "--tiny", "--parity", "--repeats", "1", "--sample", "4", "--no-hf",
                 "--out", str(tmp_path)]) == 0
    checked = json.loads((tmp_path / "shape_results.json").read_text())["parity"]
    assert [(r["sampled"], r["kernels"]) for r in checked] == [(False, "invariant"), (False, "plain"),
                                                              (True, "invariant"), (True, "plain")]
    for r in checked:
        assert r["steps"] == 4 * 3  # 4 questions, 3 steps each
        if r["kernels"] == "invariant":
            assert r["steps_differing"] == 0 and r["max_abs_diff"] == 0 and r["questions_with_other_tokens"] == 0
        else:
            assert r["steps_differing"] > 0 and r["max_abs_diff"] > 0
    assert "| greedy | invariant | 0 of 12 |" in (tmp_path / "shape_summary.md").read_text()
    assert "on a sample" not in (tmp_path / "shape_summary.md").read_text()  # every question ran: not said it was
    assert main(["--shape", "tiny", "--parity", "--tp", "2"]) == 2  # one process only


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


# --------------------------------------------------------------------------------------------------
# Many questions about one document (Table 3's sizes), llama.cpp past its cap on sequences, the FLOP rate

def _need_llamacpp() -> None:
    """As tests/test_oracle_llamacpp.py: a skip here, a failure in CI (.ci/run installs llama-cpp-python)."""
    import importlib.util
    import os

    if importlib.util.find_spec("llama_cpp") is None:
        if os.environ.get("MINILLAMA_REQUIRE_LLAMA_CPP"):
            pytest.fail("llama_cpp is missing; .ci/run installs llama-cpp-python[server]")
        pytest.skip("llama_cpp is not installed")


@pytest.mark.parametrize("n, cap, sizes", [(600, 256, [200, 200, 200]), (256, 256, [256]), (257, 256, [129, 128]),
                                           (1024, 256, [256] * 4), (1, 256, [1]), (10, 4, [4, 3, 3])])
def test_llamacpp_contexts_are_as_few_and_as_even_as_the_cap_allows(n, cap, sizes):
    from minillama.bench.llamacpp import chunks, contexts

    assert contexts(n, cap) == sizes
    idx = list(range(100, 100 + n))
    parts = chunks(idx, cap)
    assert [len(p) for p in parts] == sizes and [i for p in parts for i in p] == idx  # in order, each once


def test_llamacpp_contexts_refuse_nothing_to_split():
    from minillama.bench.llamacpp import contexts

    with pytest.raises(ValueError, match="at least 1"):
        contexts(0, 256)


def test_cost_model_and_flop_rate_against_a_hand_count():
    """TINY_SHAPE (hidden 64, 4 query heads and 2 KV heads of 16, MLP 128, 2 layers, vocab 512), counted by
    hand: a linear layer stack of 2 * (64*64 + 2*64*32 + 64*64 + 3*64*128) = 73,728 FLOPs per token and
    layer, attention 4 * 16 * 4 = 256 per visible key, the LM head 2 * 64 * 512 = 65,536 per logits row."""
    from minillama.bench.cost import flop_rates

    cost = CostModel(TINY_SHAPE)
    assert (cost.linear, cost.attn_per_key, cost.head, cost.layers) == (73_728, 256, 65_536, 2)
    doc = list(range(3, 13))  # 10 shared tokens, then 2 and 1 tokens of question; 3 new tokens each
    par = cost.parallel([doc + [20, 21], doc + [22]], [0, 0], 3)
    doc_pass = 2 * (10 * 73_728 + 55 * 256)  # 10 tokens seeing 1 + 2 + ... + 10 keys
    q1 = 2 * (2 * 73_728 + (11 + 12) * 256) + 65_536  # its 2 tokens, the logits row of the last
    q2 = 2 * (1 * 73_728 + 11 * 256) + 65_536
    step = lambda keys: 2 * (73_728 + 256 * keys) + 65_536  # noqa: E731
    decode = step(13) + step(14) + step(12) + step(13)  # 2 steps each, keys = prompt + answer so far + itself
    assert par == {"prefill": doc_pass + q1 + q2, "decode": decode, "total": doc_pass + q1 + q2 + decode}
    assert par["total"] == 2_972_160
    rates = flop_rates(2_972_160, 4_000_000, wall_s=0.5, gemm_gflops=0.25)
    assert rates == {"useful_gflops": pytest.approx(5.94432e-3), "useful_frac_of_gemm": pytest.approx(5.94432e-3 / 0.25),
                     "executed_frac_of_gemm": pytest.approx(8e-3 / 0.25)}
    assert all(math.isnan(v) for v in flop_rates(1.0, 1.0, wall_s=0.0, gemm_gflops=1.0).values())


def test_records_rate_the_useful_flops_against_a_gemm_at_the_models_shape(tmp_path, one_thread, monkeypatch):
    import minillama.bench.runner as runner

    shapes = []
    monkeypatch.setattr(runner, "gemm_rate", lambda **kw: shapes.append(kw) or 40.0)
    ctx = setup(None, TINY_SHAPE, hf=False, workdir=tmp_path)
    records, gemm = run([Case("many", TASK, ("parallel",))], ctx, repeats=2, log=lambda s: None)
    assert shapes == [{"k": 64, "n": 128}] * 2 and gemm == [40.0, 40.0]  # hidden x intermediate, each round
    r = records[0]
    assert r["gemm_gflops"] == 40.0 and r["contexts"] == 1
    assert r["useful_gflops"] == pytest.approx(r["flops_useful"] / r["wall_s"] / 1e9)
    assert r["useful_frac_of_gemm"] == pytest.approx(r["useful_gflops"] / 40.0)


def test_llamacpp_past_its_cap_runs_several_contexts_with_the_same_tokens(tmp_path, one_thread, monkeypatch):
    """10 questions at a cap of 4 sequences: contexts of 4, 3 and 3, each decoding the document once; the
    tokens are parallel's on every question, and the record charges the document once per context."""
    _need_llamacpp()
    import minillama.bench.llamacpp as llamacpp
    from tiny import tiny_config as model_config
    from tiny import tiny_model

    from minillama.bench import Context

    monkeypatch.setattr(llamacpp, "MAX_SEQUENCES", 4)
    config = model_config(head_dim=16, tied=True, vocab=TINY_SHAPE.vocab_size)
    ctx = Context(tiny_model(config), WordTokenizer(config.vocab_size), None, checkpoint=None, workdir=tmp_path)
    task_config = TaskConfig(doc_tokens=40, questions_per_doc=10, question_tokens=8, new_tokens=3, numbered=True)
    records, _ = run([Case("many", task_config, ("independent", "parallel", "llamacpp"), sample=3, once=("independent",))],
                     ctx, repeats=1, log=lambda s: None)
    by = {r["method"]: r for r in records}
    lc, par = by["llamacpp"], by["parallel"]
    assert lc["contexts"] == 3 and par["contexts"] == 1
    assert lc["identical_to_parallel"] == lc["checked_against_parallel"] == 10
    assert par["identical_to_independent"] == par["checked_against_independent"] == 3
    g = task_config.new_tokens
    assert lc["forward_passes"] == 3 * (1 + g) and lc["decode_steps"] == 3 * (g - 1)
    task = make_task(ctx.tokenizer, task_config, plain_prompt_ids(ctx.tokenizer))
    cost = CostModel(config)
    per_context = [cost.parallel(task.prompts[a:b], [0] * (b - a), g)["total"] for a, b in ((0, 4), (4, 7), (7, 10))]
    assert lc["flops_executed"] == pytest.approx(sum(per_context))
    assert lc["flops_useful"] == par["flops_useful"] < lc["flops_executed"]  # the document twice more
    # The KV bytes are the largest context's (they run one after another): the document and 4 questions.
    cells = par["doc_tokens_real"] + sum(len(p) - par["doc_tokens_real"] + g - 1 for p in task.prompts[:4])
    assert lc["kv_bytes"] == cells * 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2


def test_many_sweep_smoke(tmp_path, one_thread, monkeypatch):
    """`--only many` at --quick sizes: each question count's parallel, llama.cpp (past a cap made small)
    and the sampled independent reference; the table, the findings and the plot."""
    import minillama.bench.command as command
    import minillama.bench.llamacpp as llamacpp

    have = llamacpp.available()
    monkeypatch.setattr(llamacpp, "MAX_SEQUENCES", 5)
    assert command.main(["--quick", "--only", "many", "--repeats", "1", "--no-hf", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    by = {(r["questions"], r["method"]): r for r in data["records"]}
    methods = {"independent", "parallel"} | ({"llamacpp"} if have else set())
    assert set(by) == {(q, m) for q in (4, 12) for m in methods}
    for q in (4, 12):
        par = by[(q, "parallel")]
        assert par["question_tokens"] == 12 and par["new_tokens"] == 3 and par["generated_tokens"] == 3 * q
        assert par["identical_to_independent"] == par["checked_against_independent"] > 0
        assert data["findings"][f"parallel_tokens_per_s_q{q}"] == pytest.approx(par["tokens_per_s"])
        if have:
            assert by[(q, "llamacpp")]["contexts"] == (1 if q == 4 else 3)
            assert data["findings"][f"parallel_speedup_vs_llamacpp_q{q}"] == pytest.approx(
                by[(q, "llamacpp")]["wall_s"] / par["wall_s"])
    summary = (tmp_path / "summary.md").read_text()
    assert "## many" in summary and "| 12 | parallel | 1 |" in summary
    assert (tmp_path / "many.png").stat().st_size > 0


def test_numbered_questions_are_all_distinct():
    tok = WordTokenizer(TINY_SHAPE.vocab_size)
    config = TaskConfig(doc_tokens=100, questions_per_doc=40)  # 2 facts, 8 lead-ins: 16 distinct without numbers
    plain = make_task(tok, config, plain_prompt_ids(tok))
    numbered = make_task(tok, dataclasses.replace(config, numbered=True), plain_prompt_ids(tok))
    assert len(set(map(tuple, plain.prompts))) == 16 and len(set(map(tuple, numbered.prompts))) == 40
    assert numbered.prompts[:16] == plain.prompts[:16]  # the same task until the lead-ins run out
    assert numbered.colors == plain.colors


def test_task_bench_at_a_named_shape_runs_llamacpp_on_the_same_random_weights(tmp_path):
    """--random SHAPE: the task bench on random weights at that shape, the task's token ids, llama.cpp on an
    F32 GGUF of those weights written to the run's scratch directory."""
    _need_llamacpp()
    from minillama.bench import main

    assert main(["--random", "tiny", "--only", "many", "--questions", "16", "--methods", "parallel,llamacpp",
                 "--repeats", "1", "--no-hf", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["meta"]["model"] == "random tiny shape" and data["meta"]["gemm_shape"] == [2048, 64, 128]
    by = {r["method"]: r for r in data["records"]}
    assert set(by) == {"parallel", "llamacpp"} and by["llamacpp"]["questions"] == 16
    assert by["llamacpp"]["checked_against_parallel"] == 16 and by["parallel"]["doc_tokens"] == 512


@pytest.mark.parametrize("argv, message", [
    (["--random", "nope"], "error: argument --random: invalid choice: 'nope'"),
    (["--random", "tiny", "--quick"], "error: --random tiny: random weights replace --quick's; drop one"),
    (["--random", "tiny", "--shape", "tiny"], "error: --shape tiny runs the shape bench, --random tiny the task"),
    (["--questions", "12,many"], "error: --questions: expected comma-separated integers, got '12,many'"),
    (["--questions", "0"], "error: --questions: expected positive integers, got '0'"),
    (["--quick", "--profile", "--profile-questions", "0"], "error: --profile-questions must be at least 1, got 0"),
    # past the context: a traceback after the run began (9000), or no end writing the document out (1e20)
    (["--quick", "--profile", "--profile-questions", str(10**20)],
     "error: --profile-questions must be at most 4,096, got 1000"),
    # read by --profile alone, or by a run --from-json does not make: passed over without a word
    (["--shape", "tiny", "--tiny", "--doc-tokens", "3"], "error: --doc-tokens is --profile's: drop it, or add"),
    (["--quick", "--new-tokens", "3"], "error: --new-tokens is --profile's"),
    (["--from-json", "results.json", "--repeats", "5"], "error: --from-json renders a saved run and runs nothing: "
                                                        "drop --repeats"),
    (["--quick", "--profile", "--doc-tokens", str(10**20)], f"error: --doc-tokens {10**20}: the model's context is 1024"),
    (["--quick", "--profile", "--doc-tokens", "1020"], "error: --doc-tokens 1020: a prompt of 10"),
    (["--quick", "--only", "many", "--questions", "7"], "error: --questions 7: the many sweep of preset quick runs 4, "
                                                         "12; none of them is kept"),
    (["--quick", "--only", "many", "--methods", "hf_prefix", "--no-hf"], "error: no case left to run"),
    (["--tables", "--bogus"], "error: unrecognized arguments: --bogus"),
    # an option given empty, or to the bench that does not read it, was ignored without a word
    (["--quick", "--methods", ""], "error: --methods is empty: give a value or leave the option out"),
    (["--quick", "--only", " "], "error: --only is empty"),
    (["--quick", "--only", "grid,many", "--questions", "16"],
     "error: --questions 16: the many sweep of preset quick runs 4, 12; none of them is kept"),
    (["--quick", "--doc-lengths", "4096"], "error: --doc-lengths 4096: the doclen sweep of preset quick runs"),
    (["--from-json", "results.json", "--shape", "tiny"], "error: --from-json renders a saved run and runs nothing: "
                                                          "drop --shape"),
    (["--from-json", "results.json", "--quick"], "error: --from-json renders a saved run and runs nothing: drop --quick"),
    (["--quick", "--dtype", "float16"], "error: --dtype is the shape bench's (with --shape): drop it, or add --shape"),
    (["--quick", "--parity"], "error: --parity is the shape bench's"),
    (["--shape", "tiny", "--tiny", "--quick"], "error: --quick is the task bench's, and --shape runs the shape bench"),
    (["--shape", "tiny", "--tiny", "--profile"], "error: --profile is the task bench's"),
    (["--quick", "--profile", "--only", "many"], "error: --profile runs its own configuration"),
])
def test_bad_bench_options_are_one_line(tmp_path, capsys, argv, message):
    from minillama.bench import main

    assert main([*argv, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and captured.out == ""


def test_an_empty_out_or_a_bad_saved_run_writes_nothing(tmp_path, monkeypatch, capsys):
    """--out "" wrote the results into the current directory (over a results.json there); a --from-json that
    could not be read left an empty --out directory behind."""
    from minillama.bench import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.json").write_text('{"mine": 1}')
    assert main(["--quick", "--no-hf", "--only", "grid", "--repeats", "1", "--out", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: --out is empty: give a value or leave the option out"
    assert main(["--from-json", "missing.json", "--out", "o"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    assert (tmp_path / "results.json").read_text() == '{"mine": 1}'


def test_profile_marks_every_function_it_names_and_puts_them_back(tmp_path):
    """--profile marked functions by the module that had held them (plan_attention had moved out of model.py):
    every run was an AttributeError. Each marked function takes time in the profile, and is unwrapped after."""
    from minillama import generate, invariant, model, step
    from minillama.bench import main
    from minillama.bench.profile import _MARKED

    modules = {"step": step, "model": model, "invariant": invariant, "generate": generate}
    before = {(m, n): getattr(modules[m], n) for m in _MARKED for n in _MARKED[m]}
    assert main(["--quick", "--profile", "--out", str(tmp_path)]) == 0
    profiled = json.loads((tmp_path / "profile.json").read_text())
    for run in profiled.values():  # parallel and independent, each with both kernels
        names = {k.split(":", 1)[1] for k in run["by_function"]}
        kernels = {"blocked_attention", "tiled_linear"} if run["invariant"] else {"masked_attention"}
        assert {"plan_attention", "apply_rope_folded"} | kernels <= names, names
        assert any(k.startswith("decode:") for k in run["by_function"])  # _decode marked the decode phase
    assert all(getattr(modules[m], n) is fn for (m, n), fn in before.items())
    assert "| prefill:plan_attention |" in (tmp_path / "profile.md").read_text()


def test_quick_profile_takes_the_question_count_given(tmp_path, monkeypatch):
    """--quick --profile --profile-questions 3 profiled 8 questions, --quick's, without a word."""
    from minillama.bench import command, main

    seen = []
    monkeypatch.setattr(command, "_profile_main", lambda ctx, out, doc, questions, *a: seen.append(questions) or 0)
    for given, want in (([], 8), (["--profile-questions", "3"], 3)):
        assert main(["--quick", "--profile", *given, "--out", str(tmp_path)]) == 0
        assert seen.pop() == want


def test_a_case_past_the_models_context_is_one_line_before_any_runs(tmp_path, capsys, monkeypatch):
    """A case whose prompts do not fit the model's context was a traceback from its first method, once the
    cases before it had run (hours, in a full sweep)."""
    from minillama.bench import main, runner

    ran = []
    monkeypatch.setattr(runner, "run_case", lambda *a, **k: ran.append(1) or [])
    argv = ["--random", "tiny", "--only", "doclen", "--doc-lengths", "256,2048", "--methods", "parallel", "--no-hf",
            "--no-llamacpp", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 2 and not ran
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the doclen case doc=2048: prompts of up to"), lines


def test_a_thread_count_past_the_cpus_is_one_line(tmp_path):
    """--threads had no upper bound: 100000 ended the process (SIGSEGV, in a process of its own here) and
    99999999999 was a traceback (torch.set_num_threads: Overflow when unpacking long)."""
    from _faults import one_line_error, run_tool

    from minillama.distributed.launch import usable_cpus

    out = tmp_path / "o"
    for argv in (["--shape", "tiny", "--tiny", "--threads", "100000"], ["--quick", "--threads", "99999999999"]):
        line = one_line_error(run_tool("bench", *argv, "--out", out))
        assert line.startswith(f"error: {' '.join(argv[-2:])}: more than the {usable_cpus()} CPUs"), line
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--shape", "tiny", "--device", "xyz"], "error: --device xyz: not a torch device"),
    (["--shape", "tiny", "--device", "meta"], "error: --device meta: holds shapes, not numbers"),
    (["--shape", "tiny", "--tp", "3"], "error: --tp 3 needs a multiple of 3 ranks, got 1; start them with torchrun"),
    (["--shape", "tiny", "--tp", "0"], "error: --tp must be at least 1, got 0"),
    (["--shape", "tiny", "--tp", "-2"], "error: --tp must be at least 1, got -2"),
    (["--quick", "--tp", "2"], "error: --tp 2: only the shape bench (--shape) runs tensor parallel"),
])
def test_device_and_tp_are_checked_before_any_work(tmp_path, capsys, argv, message):
    """--device was not checked (xyz and meta were tracebacks) and --tp was taken as given: --tp 3 without
    torchrun ran one process and recorded "tp": 3; 0 and -2 ran too; the task bench ignored --tp."""
    from minillama.bench import main

    out = tmp_path / "o"
    tiny = ["--tiny"] if "--shape" in argv else []  # the shape bench's option: the task bench refuses it
    assert main([*argv, *tiny, "--repeats", "1", "--no-hf", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message) and captured.out == "", captured
    assert not out.exists()  # refused before any work: not even --out was made


def test_from_json_that_cannot_be_rendered_leaves_the_earlier_run_and_readme(tmp_path, capsys):
    """--from-json wrote results.json and results.csv (and --readme its table) before finding that the file
    lacked what the tables need (meta's preset): the earlier run in --out was overwritten."""
    from minillama.bench import main
    from minillama.bench.report import README_END, README_START

    out = tmp_path / "out"
    out.mkdir()
    earlier = {"results.json": '{"meta": "MY EARLIER RUN"}\n', "results.csv": "a,b\n1,2\n", "summary.md": "# mine\n"}
    for name, text in earlier.items():
        (out / name).write_text(text)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nmy table\n{README_END}\n")
    no_preset = json.loads((ROOT / "docs" / "bench" / "results.json").read_text())
    del no_preset["meta"]["preset"]  # the README's table renders; summary.md's title cannot
    cases = {"empty.json": ({"meta": {}, "records": []}, []), "no_preset.json": (no_preset, ["--readme", str(readme)])}
    for name, (data, extra) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        assert main(["--out", str(out), "--from-json", str(tmp_path / name), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "the results lack what the tables need (no 'preset')" in err, err
        assert {p.name: p.read_text() for p in out.iterdir()} == earlier, name
        assert readme.read_text() == f"intro\n{README_START}\nmy table\n{README_END}\n"


# The peak-memory checks run in a child process of their own: in the long test process, with the weights
# mapped from files, a machine short of memory reclaims those file pages as fast as the block claims anonymous
# ones, and the resident size need not rise at all (a CI run saw 0 bytes of the 200 MiB). A child holds
# little but NumPy, so what the block adds is what its resident size shows.
_PEAK_CHILD = """
import importlib.util, json, sys, threading, time
import numpy as np
spec = importlib.util.spec_from_file_location("memory", sys.argv[1])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
if sys.argv[2] == "no-reset":
    memory._CLEAR = "/nonexistent/clear_refs"
started = []
start = threading.Thread.start
threading.Thread.start = lambda self: (started.append(self), start(self))[1]
with memory.PeakRSS(interval=0.001) as mem:
    block = np.ones(200 * 2**20 // 8)  # 200 MiB, every page written
    time.sleep(0.05)
    del block
with memory.PeakRSS(interval=0.001) as quiet:
    pass
print(json.dumps({"sampled": mem.sampled, "threads": len(started), "delta": mem.delta, "quiet": quiet.delta}))
"""


def _peak_of_a_200_mib_block(mode: str) -> dict:
    import subprocess

    from minillama.bench import memory

    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, memory.__file__, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc high-water mark")
def test_peak_memory_is_the_kernels_exact_peak_with_no_watcher_thread():
    seen = _peak_of_a_200_mib_block("reset")
    assert not seen["sampled"] and seen["threads"] == 0  # no thread took a core from the run
    assert seen["delta"] >= 150 * 2**20  # the freed block's peak is still seen
    assert seen["quiet"] < 50 * 2**20  # the control: the mark was reset, so a run that allocates nothing is small


def test_peak_memory_falls_back_to_sampling_where_the_mark_cannot_be_reset():
    seen = _peak_of_a_200_mib_block("no-reset")
    assert seen["sampled"] and seen["threads"] == 2 and seen["delta"] >= 150 * 2**20


AHEAD_PASSED = {name: True for name in ("greedy", "sampled", "serve_greedy", "serve_sampled")}


def test_gpu_check_falls_back_to_the_host_in_step_where_decoding_ahead_fails(monkeypatch):
    """gpu_check's first step: where decoding ahead of the host breaks (here: a planted fault, or answers
    that differ), the rest of the check runs with the host in step, and says so; where it works, nothing
    changes. The setting is the check's own: put back when it ends."""
    from minillama import step as step_module
    from minillama.bench import device, gpu_check
    from tiny import tiny_config, tiny_model

    assert gpu_check.check_ahead("cpu") == AHEAD_PASSED
    logged = []
    assert gpu_check.keep_ahead({"result": {"greedy": True, "sampled": True}}, logged.append)
    assert step_module.OVERLAP is None and not logged
    monkeypatch.setattr(step_module, "OVERLAP", None)
    for broken in ({"error": "RuntimeError: planted"}, {"result": {"greedy": True, "sampled": False}}):
        step_module.OVERLAP = None
        assert not gpu_check.keep_ahead(broken, logged.append)
        assert step_module.OVERLAP is False and "FAILED" in logged[-1]
        assert tiny_model(tiny_config()).steps.overlap is False  # every model made after it
        seen = []  # and every bench run of one (the H200 run at f9e71c4 ran ahead after its fallback)
        model = tiny_model(tiny_config())
        monkeypatch.setattr(device, "generate", lambda m, *a, **k: seen.append(m.steps.overlap) or [])
        device._run_minillama(model, [[5, 6]], [0], 2, "parallel", True)
        assert seen == [False], seen
    real = step_module.Steps.overlapping

    def planted(self, device):  # negative control of check_ahead: a loop ahead of the host that breaks
        if self.overlap:
            raise RuntimeError("planted")
        return real(self, device)

    monkeypatch.setattr(step_module.Steps, "overlapping", planted)
    with pytest.raises(RuntimeError, match="planted"):
        gpu_check.check_ahead("cpu")


def test_gpu_check_times_the_serve_engine_ahead_and_in_step():
    """The SmolLM2 host step's serve-engine timing (on a GPU), at a tiny size on a CPU: both ways answer every
    question (the engine's counters), and the ratio is theirs."""
    from minillama.bench import gpu_check
    from minillama.bench.device import HEADLINE, random_model
    from minillama.bench.shapes import SHAPES
    from minillama.serve import engine as engine_module

    model, _ = random_model(SHAPES["tiny"], torch.device("cpu"), torch.float32)
    prompts = HEADLINE.build(model.config.vocab_size)[0][:8]
    engines = []
    real = engine_module.Engine.__init__

    def kept(self, *args, **kwargs):
        real(self, *args, **kwargs)
        engines.append(self)

    with mock.patch.object(engine_module.Engine, "__init__", kept):
        t = gpu_check.engine_times(model, prompts, 3, torch.device("cpu"), repeats=1)
    assert t["in_step_over_ahead"] == t["in_step_s"] / t["ahead_s"] and t["ahead_s"] > 0
    assert len(engines) == 2 * (gpu_check.WARM_RUNS + 1)  # each setting's warm-ups and its one timed run
    assert all(e.decode_tokens == 8 * 2 and not e.running for e in engines)
    assert model.steps.overlap is None  # put back


def test_gpu_check_refuses_a_device_torch_does_not_know(tmp_path, capsys):
    """--device bogus ran every step into a RuntimeError, wrote that as the JSON (over an earlier one) and
    exited 0."""
    from minillama.bench import gpu_check

    out = tmp_path / "check.json"
    out.write_text("earlier")
    assert gpu_check.main(["--quick", "--device", "bogus", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: --device bogus: not a torch device"
    assert out.read_text() == "earlier"


def test_gpu_check_runs_every_step_and_writes_one_json(tmp_path):
    """The GPU machine's one script, its steps at tiny sizes on a CPU: the test run's counts, parity
    (invariant: no step differs; plain kernels: some do), the bench's methods and the targets' ratios, a
    second process's compiled run on the first's compile cache (read, not compiled), and
    the served run's identity (the plain kernels' choices differ from their solo runs: the control)."""
    import json

    import subprocess

    from minillama.bench import gpu_check

    out = tmp_path / "check.json"
    # its own process, as on the GPU machine: nothing an earlier test left (torch's threads, compiled code)
    proc = subprocess.run([sys.executable, "-m", "minillama.bench.gpu_check", "--quick", "--device", "cpu", "--out",
                           str(out), "--compiled"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["source_sha256"] == gpu_check.source_digest() and len(data["source_sha256"]) == 64
    assert data["steps"]["ahead"]["result"] == AHEAD_PASSED and data["ahead_fallback"] is False
    tests = data["steps"]["tests"]["result"]
    assert tests["exit"] == 0 and tests["passed"] > 0 and not tests.get("failed")
    bench = data["steps"]["bench tiny float32"]["result"]
    by_kernels = {(r["kernels"], r["sampled"]): r["steps_differing"] for r in bench["parity"]}
    assert by_kernels[("invariant", False)] == by_kernels[("invariant", True)] == 0
    assert by_kernels[("plain", False)] > 0
    assert by_kernels[("invariant, compiled", False)] == by_kernels[("invariant, compiled", True)] == 0
    # at the units `minillama generate` takes by default (the tiny shape's 2 KV heads), the invariant kernels
    assert by_kernels[("invariant, units 2", False)] == by_kernels[("invariant, units 2", True)] == 0
    assert {r["method"] for r in bench["records"]} >= {"parallel", "parallel_plain", "independent", "parallel_compiled",
                                                       "parallel_units"}
    assert {"exact_over_plain", "parallel_over_floor", "compiled_over_parallel", "units_over_one"} <= set(bench["targets"])
    assert bench["targets"]["compiled_first_run_s"] == bench["meta"]["compiled_first_run_s"] > 0
    # a second process on the cache directory the first compiled into: every graph read, none compiled cold
    second = bench["meta"]["compiled_warm"]
    assert second["graph_cache_hits"] > 0 and second["graph_cache_misses"] == 0
    assert bench["targets"]["compiled_warm_first_run_s"] == second["first_run_s"] > second["steady_s"] > 0
    tiles = data["steps"]["tiles tiny float32"]["result"]
    assert "Self CPU" in tiles["profile"]["by_device_time"] and "Self CPU" in tiles["profile_compiled"]["by_device_time"]
    assert "minillama::tiled_linear" in tiles["profile_compiled"]["by_device_time"]  # the compiled layers ran
    assert any(p["kind"] == "short" and p["proven"] for p in tiles["proofs"])  # the CPU's short tiles, proven
    assert any(p["kind"] == "attention rows" and p["proven"] for p in tiles["proofs"])  # and short item tiles
    rows = data["steps"]["rows tiny float32"]["result"]  # which products keep a row's bits with fewer rows
    assert rows["tile"] == 64 and {"q", "down", "q unit", "down unit"} <= set(rows["linear"])
    for r in rows["linear"].values():
        assert set(r["ms"]) == {"1", "16", "64"} and set(r["same_bits_random"]) <= {1, 16}
    assert set(rows["attention"]) == {"whole", "partial"}
    for split in tiles["host"].values():  # where the host's time went, ahead of the device and in step
        assert split["wall_s"] > split["lay_out_s"] > 0 and split["wait_s"] >= 0
        assert split["other_s"] == pytest.approx(split["wall_s"] - split["lay_out_s"] - split["wait_s"])
    served = data["steps"]["serve"]["result"]  # `minillama serve` over HTTP: each choice against its solo run
    assert served["invariant"]["identical"] == served["invariant"]["choices"] > 0
    assert served["plain"]["identical"] < served["plain"]["choices"]  # the control: the plain kernels differ


def test_a_failing_second_compiled_process_costs_only_its_own_figure():
    """bench/warm.py's process failing (here: a device torch does not know), or running past its time, is
    an error record: gpu_check keeps the shape bench's figures beside it."""
    from minillama.bench import warm

    failed = warm.warm_run("tiny", "float32", "nodevice", True)
    assert set(failed) == {"error"} and "the second process failed" in failed["error"], failed
    slow = warm.warm_run("tiny", "float32", "cpu", True, timeout_s=0.01)
    assert slow == {"error": "the second process took more than 0.01 s"}


def test_the_second_compiled_process_runs_with_this_ones_threads(monkeypatch):
    """Inductor's CPU code holds the thread count, and so does its cache key: a second process with other
    threads compiles again (a full test run left torch at 1 thread, and the second process missed every
    graph). So the second process takes this one's."""
    import subprocess

    from minillama.bench import warm

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd) or subprocess.CompletedProcess(
        cmd, 0, '{"first_run_s": 1.0}\n', ""))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert warm.warm_run("tiny", "float32", "cpu", True)["first_run_s"] == 1.0
    finally:
        torch.set_num_threads(saved)
    assert seen[0][-2:] == ["--threads", "1"]


def test_gpu_check_serve_step_says_what_is_missing(monkeypatch):
    """Where the device's Python lacks starlette or uvicorn, the served run is skipped with what to carry."""
    import importlib.util

    from minillama.serve import identity

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert identity.on_device("cpu", 2, 1) == {"skipped": "uvicorn not installed: carry the wheels (docs/gpu.md)"}


def test_gpu_check_times_no_capture_in_the_host_split(monkeypatch):
    """`host_split` times one run of each setting: with its `WARM_RUNS` before it, that run captures no step
    (a stand-in for the CUDA graph counts captures on a CPU). Negative control: one warm-up, as at f9e71c4,
    leaves the prefill's capture (a pass met once a run) in the timed run."""
    from minillama.bench import device, gpu_check
    from test_step import Rerun, _captured
    from tiny import tiny_config, tiny_model

    prompts = [[3 + i % 40 for i in range(40)] + [5 + q, 6, 7 + q] for q in range(6)]
    real = device._run_minillama

    def new_captures(warm_runs: int) -> list[int]:
        capture = Rerun()
        model = _captured(tiny_model(tiny_config()), capture)
        calls = []

        def counted(*args, **kwargs):
            before = capture.captures
            out = real(*args, **{**kwargs, "captured": True})  # None (the default) captures on CUDA only
            calls.append(capture.captures - before)
            return out

        monkeypatch.setattr(gpu_check, "WARM_RUNS", warm_runs)
        monkeypatch.setattr(device, "_run_minillama", counted)
        split = gpu_check.host_split(model, prompts, [0] * len(prompts), 4, torch.device("cpu"))
        assert set(split) == {"ahead", "in_step"} and len(calls) == 2 * (warm_runs + 1)
        return calls

    calls = new_captures(gpu_check.WARM_RUNS)
    timed = calls[gpu_check.WARM_RUNS], calls[-1]
    assert sum(calls) > 0 and timed == (0, 0), calls
    assert new_captures(1)[1] > 0  # the negative control: the first timed run captured



def test_threads_hold_for_one_call_of_the_bench(monkeypatch):
    """`--threads` sets torch's thread count for that call only: a test (or a notebook) that calls the bench
    in-process keeps its own count afterwards, whether the bench finished or stopped on an error."""
    from minillama.bench import command
    from minillama.errors import BadInput

    def stop(*a, **k):
        assert torch.get_num_threads() == 1  # the bench ran at the count asked for
        raise BadInput("stopped here")

    monkeypatch.setattr(command, "preset", stop)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert command.main(["--quick", "--threads", "1", "--no-hf", "--no-llamacpp"]) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
