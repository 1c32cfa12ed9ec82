"""The benchmark harness on a tiny random model: the task, the cost model, the records and files it
writes, and that parallel (and batched) answers are the independent ones. Timings are never asserted."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from minillama.bench import (METHODS, TINY_SHAPE, Case, CostModel, TaskConfig, WordTokenizer, make_task,
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


def test_shape_bench_runs_on_cpu_against_its_roofline(tmp_path, one_thread):
    from minillama.bench import main

    assert main(["--shape", "tiny", "--tiny", "--tables", "--repeats", "1", "--sample", "2",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "shape_results.json").read_text())
    assert data["meta"]["gemm_tflops"] > 0 and data["meta"]["bandwidth_gbs"] > 0
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
