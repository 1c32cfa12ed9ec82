"""The oracle: minillama checked against HF transformers, and broken candidates caught and located.

A tiny random model is saved as an HF directory that both minillama and transformers load. Against the
intact HF model every question passes; against HF models broken the way ports break (one weight perturbed,
the wrong RoPE theta, Q/K rows left in GGUF order, question tokens one position off) the verdict fails and
the layer diff names the layer and sub-module where the activations first leave tolerance. The default
model (marked slow, run in CI) passes against transformers through the command line.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from minillama import weights
from minillama.errors import CannotWrite
from minillama.oracle import (MinillamaBackend, Record, Tolerances, TransformersBackend, activation_names, compare,
                              export, layer_diff, load, run_backend, save)
from minillama.oracle.__main__ import main
from minillama.oracle.backends import BackendError, LlamaCppBackend
from minillama.oracle.diff import diff_hidden
from minillama.oracle.schema import RecordError
from minillama.oracle.tolerances import PRESETS
from tiny import VOCAB, tiny_config, tiny_model

LAYERS = 3
DOC = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # the shared document: 10 tokens
PROMPTS = [DOC + [20, 21], DOC + [30, 31, 32], [40, 41, 42, 43]]
DOCS = [0, 0, 1]
STEPS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = tiny_config(layers=LAYERS, heads=4, kv_heads=2, head_dim=8, theta=10000.0)
    model = tiny_model(config, seed=1)
    path = tmp_path_factory.mktemp("oracle") / "tiny"
    weights.save_hf_dir(config, model.state_dict(), None, path)
    return config, model, path


@pytest.fixture(scope="module")
def ref(tiny):
    _, model, path = tiny
    return export(model, PROMPTS, docs=DOCS, max_new_tokens=STEPS, model_path=str(path))


@pytest.fixture(scope="module")
def ref_acts(tiny, ref):
    """minillama's activations on each question's prompt and answer, for every layer diff."""
    backend = MinillamaBackend(tiny[1])
    return [backend.activations(q.prompt_ids + q.token_ids[:-1]) for q in ref.questions]


@pytest.fixture(scope="module")
def hf_intact(tiny):
    return TransformersBackend.load(tiny[2]).model


def hf(intact, theta: float | None = None):
    """A copy of the HF model to break, with another RoPE theta if asked."""
    if theta is None:
        return copy.deepcopy(intact)
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(intact.config)
    config.rope_parameters["rope_theta"] = theta
    model = LlamaForCausalLM(config)
    model.load_state_dict(intact.state_dict())
    return model.eval()


def check(ref: Record, ref_acts, backend, tol: Tolerances | None = None):
    """Per-question results, each with its layer diff."""
    tol = tol or Tolerances()
    results = compare(ref, run_backend(ref, backend), tol)
    for r, q, acts in zip(results, ref.questions, ref_acts):
        r.layers = layer_diff(acts, backend.activations(q.prompt_ids + q.token_ids[:-1]), tol)
    return results


# --------------------------------------------------------------------------------------------------
# Against HF transformers


def test_transformers_agrees_on_a_tiny_model(tiny, ref, ref_acts):
    results = check(ref, ref_acts, TransformersBackend.load(tiny[2]))
    assert [r.passed for r in results] == [True] * len(PROMPTS), [r.reason for r in results]
    for r in results:
        assert r.compared == STEPS and r.first_divergence is None and r.top_k_overlap == 1.0
        assert r.logit_max < 1e-5 and r.logprob_max < 1e-5
        assert r.layers.first_bad is None
        assert [row.name for row in r.layers.rows] == activation_names(LAYERS)


@pytest.mark.parametrize("module, layer, name, kind", [
    ("mlp.down_proj", 1, "layers.1.mlp", "MLP"),
    ("self_attn.o_proj", 2, "layers.2.self_attn", "attention"),
    ("self_attn.v_proj", 0, "layers.0.self_attn.v_proj", "attention"),
    ("post_attention_layernorm", 1, "layers.1.post_attention_layernorm", "norm"),
])
def test_a_weight_perturbed_in_one_layer_is_located(ref, ref_acts, hf_intact, module, layer, name, kind):
    broken = hf(hf_intact)
    with torch.no_grad():
        broken.get_submodule(f"model.layers.{layer}.{module}").weight.view(-1)[3] += 0.05
    results = check(ref, ref_acts, TransformersBackend(broken))
    assert not any(r.passed for r in results)
    for r in results:
        assert "out of tolerance" in r.reason
        bad = r.layers.first_bad
        assert (bad.layer, bad.kind, bad.name) == (layer, kind, name)


def test_a_wrong_rope_theta_is_located(ref, ref_acts, hf_intact):
    results = check(ref, ref_acts, TransformersBackend(hf(hf_intact, theta=100000.0)))
    assert not any(r.passed for r in results)
    for r in results:
        bad = r.layers.first_bad
        # Position 0 is not rotated at all: the first token out of tolerance is token 1.
        assert (bad.name, bad.kind, bad.layer, bad.first_bad_token) == ("layers.0.self_attn.q_rope", "RoPE", 0, 1)
        assert "rope_theta ~ 1e+05 against the reference's 1e+04" in r.layers.hint


def test_a_missing_qk_permutation_is_located(tiny, ref, ref_acts, hf_intact):
    from _ckpt_writers import half_to_interleaved

    config = tiny[0]
    broken = hf(hf_intact)
    with torch.no_grad():  # Q/K rows as a GGUF file stores them, loaded without `interleaved_to_half`
        for layer in broken.model.layers:
            q, k = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
            q.copy_(half_to_interleaved(q.clone(), config.num_attention_heads))
            k.copy_(half_to_interleaved(k.clone(), config.num_key_value_heads))
    results = check(ref, ref_acts, TransformersBackend(broken))
    assert not any(r.passed for r in results)
    for r in results:
        bad = r.layers.first_bad
        assert (bad.name, bad.kind, bad.layer, bad.first_bad_token) == ("layers.0.self_attn.q_proj", "attention", 0, 0)
        assert "interleaved RoPE order" in r.layers.hint


def test_question_tokens_one_position_off_are_located(ref, ref_acts, hf_intact):
    shared = len(DOC)
    assert [q.shared for q in ref.questions[:2]] == [shared, shared]

    def question_positions_off_by_one(n: int) -> torch.Tensor:  # the document right, its questions one late
        p = torch.arange(n)
        p[shared:] += 1
        return p

    results = check(ref, ref_acts, TransformersBackend(hf(hf_intact), positions=question_positions_off_by_one))
    for r in results[:2]:
        assert not r.passed
        bad = r.layers.first_bad
        assert (bad.name, bad.kind, bad.layer, bad.first_bad_token) == ("layers.0.self_attn.q_rope", "RoPE", 0, shared)
        assert f"token {shared} is rotated as the reference rotates token {shared + 1}" in r.layers.hint
        assert "off by +1" in r.layers.hint


# --------------------------------------------------------------------------------------------------
# Verdicts on candidate answers


def candidate(ref: Record, **changes) -> Record:
    c = copy.deepcopy(ref)
    c.manifest = {}
    for q in c.questions:
        for k, v in changes.items():
            setattr(q, k, v)
    return c


def test_logit_errors_are_judged_by_the_tolerances(ref):
    tol = Tolerances(atol=1e-4, rtol=0.0)
    for delta, passed in ((5e-5, True), (3e-4, False)):
        c = candidate(ref)
        c.questions[1].logits[3, 7] += delta
        results = compare(ref, c, tol)
        assert [r.passed for r in results] == [True, passed, True]
        assert results[1].logit_max == pytest.approx(delta, rel=1e-2)
        if not passed:
            assert results[1].reason.startswith("logits out of tolerance from step 3")


def test_nan_logits_fail(ref):
    c = candidate(ref)
    c.questions[0].logits[2, 0] = float("nan")
    assert not compare(ref, c)[0].passed


def test_token_ids_alone_must_agree_exactly(ref):
    c = candidate(ref, logits=None, logprobs=None)
    assert all(r.passed for r in compare(ref, c))
    q = c.questions[0]
    q.token_ids = q.token_ids[:2] + [(q.token_ids[2] + 1) % 61] + q.token_ids[3:]
    r = compare(ref, c)[0]
    assert not r.passed and r.first_divergence == 2 and r.compared == 3
    assert r.reason.startswith("tokens differ at step 2")


def test_logprobs_of_the_chosen_tokens_are_checked(ref):
    c = candidate(ref, logits=None)
    assert all(r.passed for r in compare(ref, c))
    c.questions[2].logprobs[5] -= 1e-2
    r = compare(ref, c)[2]
    assert not r.passed and r.logprob_max == pytest.approx(1e-2, rel=1e-3)


def test_a_files_logprobs_are_checked_beside_its_logits(ref):
    """Both given: the log-probs were once ignored, and a file whose logits agree passed with any of them."""
    from minillama.oracle.diff import Comparison, hints

    for bad, hint in ((1e-2, None), (float("nan"), "NaN or inf values")):
        c = candidate(ref)
        c.questions[1].logprobs[3] += bad
        results = compare(ref, c)
        assert [r.passed for r in results] == [True, False, True]
        assert results[1].reason == "logprob of the chosen token out of tolerance from step 3"
        if hint:
            assert hint in hints(Comparison({}, {}, Tolerances(), results))[0]


def test_a_reference_whose_tokens_are_not_its_greedy_choice_is_bad_input(ref):
    """An edited reference token: the candidate's true one parted from it at a "near tie" of negative margin."""
    r_ = copy.deepcopy(ref)
    q = r_.questions[0]
    q.token_ids = [int(q.logits[0].argsort()[-2])] + q.token_ids[1:]
    with pytest.raises(RecordError, match="the reference's token .* at step 0 is not the greedy choice"):
        compare(r_, candidate(ref, logits=None))


def test_nan_in_one_question_is_named_by_the_hint(ref):
    """max() keeps a NaN only where it comes first: a NaN after a finite error once read as rounding."""
    from minillama.oracle.diff import Comparison, hints

    c = candidate(ref)
    c.questions[0].logits = c.questions[0].logits + 0.01
    c.questions[1].logits = torch.full_like(c.questions[1].logits, float("nan"))
    got = hints(Comparison({}, {}, Tolerances(), compare(ref, c, PRESETS["half"])))
    assert len(got) == 1 and "NaN or inf values" in got[0], got


def test_an_answer_that_goes_on_after_the_reference_stopped(ref):
    """Past a stop token the candidate did not stop: a failure; past the reference's length limit, a note."""
    for finish, passed in (("stop", False), ("length", True)):
        r_ = copy.deepcopy(ref)
        r_.questions[0].finish_reason = finish
        c = candidate(r_, logits=None, logprobs=None)
        c.questions[0].token_ids = c.questions[0].token_ids + [3, 4]
        res = compare(r_, c)[0]
        assert res.passed == passed
        if passed:
            assert res.notes == ["the candidate goes on for 2 steps after the reference stopped"]
        else:
            assert res.reason.startswith("the candidate goes on for 2 steps after the reference's stop token")


def test_tokens_may_part_only_at_a_near_tie(ref):
    step = 4
    for gap, passed in ((5e-5, True), (1e-2, False)):
        r_ = copy.deepcopy(ref)
        q = r_.questions[0]
        best, other = q.token_ids[step], (q.token_ids[step] + 1) % 61
        q.logits[step, other] = q.logits[step, best] - gap  # the reference prefers `best` by `gap`
        parted = q.token_ids[:step] + [other] + [3] * (STEPS - step - 1)  # the candidate picks `other`, goes on

        with_logits = candidate(r_)
        cq = with_logits.questions[0]
        cq.logits[step, other] = cq.logits[step, best] + 1e-6
        cq.logits[step + 1:] += 1.0  # after parting its context differs: those steps are not compared
        cq.token_ids = parted
        cq.logprobs = torch.log_softmax(cq.logits, dim=-1).gather(1, torch.tensor(parted)[:, None])[:, 0]
        res = compare(r_, with_logits)[0]
        assert (res.passed, res.first_divergence, res.compared) == (passed, step, step + 1)
        if passed:
            assert any("near tie" in n for n in res.notes)
        else:
            assert res.reason.startswith(f"logits out of tolerance from step {step}")

        # With logprobs only, the candidate's logprob of `other` is the reference's own: only the margin
        # tells a near tie from a wrong choice.
        with_logprobs = candidate(r_, logits=None)
        cq = with_logprobs.questions[0]
        cq.token_ids = parted
        cq.logprobs[step] = torch.log_softmax(q.logits[step], dim=-1)[other]
        res = compare(r_, with_logprobs)[0]
        assert (res.passed, res.first_divergence, res.compared) == (passed, step, step + 1)
        if not passed:
            assert res.reason.startswith(f"tokens differ at step {step}") and "more than the tolerances" in res.reason


def test_hidden_states_in_two_records_locate_a_layer(tiny):
    _, model, _ = tiny
    ref = export(model, PROMPTS[:1], max_new_tokens=4, hidden=True)
    n = len(PROMPTS[0]) + 4 - 1
    assert ref.questions[0].hidden.shape == (LAYERS + 1, n, model.config.hidden_size)
    emb = model.model.embed_tokens.weight[torch.tensor(PROMPTS[0] + ref.questions[0].token_ids[:-1])]
    assert torch.equal(ref.questions[0].hidden[0], emb)
    c = copy.deepcopy(ref)
    c.questions[0].hidden[2] += 0.1  # the output of block 1
    (d,) = diff_hidden(ref, c, Tolerances())
    assert d.first_bad.name == "layers.1" and d.first_bad.layer == 1
    c.questions[0].hidden = c.questions[0].hidden[:2]  # a part of the blocks: once compared as far as it went
    with pytest.raises(RecordError, match=f"the reference holds hidden states of {LAYERS + 1} blocks"):
        diff_hidden(ref, c, Tolerances())


def test_hidden_states_of_another_shape_are_bad_input(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    _, model, _ = tiny
    save(export(model, PROMPTS[:1], max_new_tokens=4, hidden=True), tmp_path / "ref.safetensors")
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    tensors["q0.hidden"] = tensors["q0.hidden"].reshape(-1)  # once an IndexError
    save_file(tensors, str(tmp_path / "flat.safetensors"))
    assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--candidate",
                 str(tmp_path / "flat.safetensors"), "--layers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hidden must be (layers + 1, tokens, hidden size)" in err, err


def test_hidden_states_over_fewer_tokens_are_bad_input(tiny, tmp_path, capsys):
    """Two records cut alike were compared over the rows both had; empty ones raised from torch."""
    from safetensors.torch import load_file, save_file

    _, model, _ = tiny
    save(export(model, PROMPTS[:1], max_new_tokens=4, hidden=True), tmp_path / "ref.safetensors")
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    for rows in (3, 0):
        tensors["q0.hidden"] = tensors["q0.hidden"][:, :rows].clone()
        save_file(tensors, str(tmp_path / "cut.safetensors"))
        assert main(["compare", "--reference", str(tmp_path / "cut.safetensors"), "--candidate",
                     str(tmp_path / "cut.safetensors"), "--layers"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"over {len(PROMPTS[0]) + 3} tokens; got (4, {rows}, " in err, err


def test_a_question_without_hidden_states_is_noted_under_layers(tiny, tmp_path, capsys):
    """--layers from files compares the questions both hold hidden states for; the others were once passed
    over in silence, so a report read as a layer diff of every question."""
    from safetensors.torch import load_file, save_file

    _, model, _ = tiny
    save(export(model, PROMPTS[:2], max_new_tokens=4, hidden=True), tmp_path / "ref.safetensors")
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    del tensors["q1.hidden"]
    save_file(tensors, str(tmp_path / "part.safetensors"))
    assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--candidate",
                 str(tmp_path / "part.safetensors"), "--layers"]) == 0
    out = capsys.readouterr().out
    assert out.count("no layer diff: a file holds no hidden states") == 1, out


def test_a_manifests_null_fields_are_not_a_traceback(ref, tmp_path, capsys):
    save(ref, tmp_path / "ref.safetensors")
    _rewrite_manifest(tmp_path / "ref.safetensors", tmp_path / "null.safetensors", backend=None, mode=None)
    assert main(["compare", "--reference", str(tmp_path / "null.safetensors"), "--candidate",
                 str(tmp_path / "ref.safetensors")]) == 0
    assert capsys.readouterr().out.startswith("reference  minillama, ? mode, greedy")


# --------------------------------------------------------------------------------------------------
# Backends


def test_transformers_reads_gguf_through_its_own_loader(tmp_path):
    from _ckpt_writers import byte_bpe_tokenizer, gguf_tokenizer_metadata, random_state_dict, write_gguf
    from _ckpt_writers import tiny_config as ckpt_config

    config = ckpt_config(vocab=320)
    path = write_gguf(tmp_path / "m.gguf", config, random_state_dict(config), gguf_tokenizer_metadata(
        byte_bpe_tokenizer()))
    model, _ = weights.load_model(path)
    backend = TransformersBackend.load(path)
    assert "via gguf_file" in backend.describe()
    ref = export(model, [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]], max_new_tokens=6)
    assert all(r.passed for r in compare(ref, run_backend(ref, backend)))


class _FakeLlamaCpp:
    """Stands in for llama_cpp.Llama: the documented reset / eval / scores API, computed by minillama."""

    model = None

    def __init__(self, model_path, n_ctx, logits_all, verbose):
        assert logits_all and not verbose
        self.scores = torch.zeros(n_ctx, self.model.config.vocab_size).numpy()
        self.ids: list[int] = []
        self.n_tokens = 0

    def reset(self):
        self.n_tokens = 0

    def n_vocab(self):
        return self.model.config.vocab_size

    def eval(self, tokens):  # appends to the tokens evaluated since the last reset
        self.ids = self.ids[:self.n_tokens] + list(tokens)
        self.n_tokens = len(self.ids)
        self.scores[:self.n_tokens] = self.model(torch.tensor(self.ids)).numpy() + 0.01  # stands for quantization


def test_llama_cpp_backend_is_tolerance_based(tiny, ref, tmp_path, monkeypatch):
    _, model, _ = tiny
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlamaCpp, __version__="fake"))
    monkeypatch.setattr(_FakeLlamaCpp, "model", model)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    backend = LlamaCppBackend(tmp_path / "m.gguf")
    assert not any(r.passed for r in compare(ref, run_backend(ref, backend)))
    results = compare(ref, run_backend(ref, backend), Tolerances(atol=0.02, logprob_atol=1e-4))
    assert all(r.passed for r in results)
    assert all(r.logit_max == pytest.approx(0.01, abs=1e-5) for r in results)
    with pytest.raises(BackendError, match="no layer-by-layer activations"):
        backend.activations([1, 2, 3])


def test_a_backend_of_another_vocabulary_is_refused_before_it_runs(ref, tmp_path, capsys, monkeypatch):
    """A reference token id past the backend's vocabulary failed inside the backend (transformers' IndexError,
    llama.cpp's 'llama_decode returned -1'): a traceback and exit 1, read as a failing question. A backend with
    a larger vocabulary was blamed for a token id outside the reference's vocabulary, or its logits' width was
    refused after the run."""
    top = max(t for q in ref.questions for t in q.prompt_ids + q.token_ids)
    save(ref, tmp_path / "ref.safetensors")
    for vocab, message in ((top, f"the reference's token ids reach {top}; the backend's vocabulary has {top} "
                                 "tokens"),
                           (VOCAB + 3, f"the reference's vocabulary has {VOCAB} tokens (its logits), the backend's "
                                       f"{VOCAB + 3}: not one model's")):
        config = tiny_config(layers=1, vocab=vocab)
        path = tmp_path / f"vocab{vocab}"
        weights.save_hf_dir(config, tiny_model(config, seed=1).state_dict(), None, path)
        assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--backend", "transformers",
                     "--backend-model", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlamaCpp, __version__="fake"))
        monkeypatch.setattr(_FakeLlamaCpp, "model", tiny_model(config, seed=1))
        (tmp_path / "m.gguf").write_bytes(b"GGUF")
        with pytest.raises(RecordError, match=re.escape(message)):
            run_backend(ref, LlamaCppBackend(tmp_path / "m.gguf"))


def test_layers_beside_a_reference_rebuild_it_in_the_records_dtype(tiny, tmp_path, capsys):
    """With --reference and --backend transformers --layers, the reference model was rebuilt at --dtype (float32
    by default), not the record's: a bfloat16 record's logits failed while its layer diff, of another reference,
    said every activation was within tolerance (1e-7 of the scale)."""
    _, _, path = tiny
    out = tmp_path / "bf16.safetensors"
    assert main(["export", "-m", str(path), "--prompt-ids", _write_prompts(tmp_path), "-n", "3", "--dtype",
                 "bfloat16", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["compare", "--reference", str(out), "--backend", "transformers", "--layers", "--json"]) == 1
    for q in json.loads(capsys.readouterr().out)["questions"]:
        assert (q["layers"]["first_bad"]["name"], q["layers"]["first_bad"]["kind"]) == ("embed", "embedding")
    _rewrite_manifest(out, tmp_path / "f64.safetensors", dtype="float64")
    assert main(["compare", "--reference", str(tmp_path / "f64.safetensors"), "--backend", "transformers",
                 "--layers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layers: the reference was made in float64, which minillama does not" in err


def test_llama_cpp_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    with pytest.raises(BackendError, match=r"pip install llama-cpp-python"):
        LlamaCppBackend(tmp_path / "m.gguf")


# --------------------------------------------------------------------------------------------------
# Files and the command line


def test_record_round_trip(tiny, ref, tmp_path):
    _, model, path = tiny
    manifest_file = save(ref, tmp_path / "ref.safetensors")
    got = load(tmp_path / "ref.safetensors")
    for a, b in zip(ref.questions, got.questions):
        assert (a.prompt_ids, a.token_ids, a.shared, a.doc) == (b.prompt_ids, b.token_ids, b.shared, b.doc)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.logprobs, b.logprobs)
    m = json.loads(manifest_file.read_text())
    assert m["model"]["path"] == str(path) and m["model"]["config"]["num_hidden_layers"] == LAYERS
    assert (m["dtype"], m["device"], m["mode"]) == ("float32", "cpu", "parallel")
    assert m["versions"]["torch"] == torch.__version__ and "minillama_commit" in m
    assert [q["prompt_ids"] for q in m["questions"]] == PROMPTS
    # The logits are the raw rows generate() sampled from: greedy picks their argmax.
    assert all(q.logits.argmax(-1).tolist() == q.token_ids for q in got.questions)


def _write_prompts(tmp_path) -> str:
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"prompt_ids": ids, "doc": d}) for ids, d in zip(PROMPTS, DOCS)) + "\n")
    return str(p)


def test_cli_export_then_compare(tiny, tmp_path, capsys):
    _, _, path = tiny
    out = tmp_path / "ref.safetensors"
    assert main(["export", "-m", str(path), "--prompt-ids", _write_prompts(tmp_path), "-n", "5",
                 "-o", str(out)]) == 0
    assert (tmp_path / "ref.json").exists()
    capsys.readouterr()

    assert main(["compare", "--reference", str(out), "--backend", "transformers", "--layers", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["passed"] and len(got["questions"]) == 3
    assert got["questions"][0]["layers"]["first_bad"] is None

    rec = load(out)
    lines = [{"token_ids": q.token_ids, "logprobs": q.logprobs.tolist()} for q in rec.questions]
    lines[1]["token_ids"][2] = (lines[1]["token_ids"][2] + 1) % 61
    cand = tmp_path / "cand.jsonl"
    cand.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert main(["compare", "--reference", str(out), "--candidate", str(cand)]) == 1
    text = capsys.readouterr().out
    assert "2 of 3 questions pass: FAIL" in text and "step 2" in text


def test_cli_report_on_a_broken_candidate_names_the_layer(tiny, tmp_path, capsys):
    _, model, path = tiny
    broken = tmp_path / "broken"
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.layers.2.mlp.up_proj.weight"][0, 0] += 0.5
    weights.save_hf_dir(model.config, sd, None, broken)
    code = main(["compare", "-m", str(path), "--prompt-ids", _write_prompts(tmp_path), "-n", "4",
                 "--backend", "transformers", "--backend-model", str(broken), "--layers"])
    text = capsys.readouterr().out
    assert code == 1
    assert "first out of tolerance: layer 2 MLP (layers.2.mlp)" in text
    assert "0 of 3 questions pass: FAIL" in text


def _rewrite_manifest(src, dst, **changes) -> None:
    """A copy of record `src` at `dst` with its manifest's fields changed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    manifest = {**json.loads(meta["minillama-oracle"]), **changes}
    save_file(tensors, str(dst), metadata={"minillama-oracle": json.dumps(manifest)})


@pytest.mark.parametrize("args, message", [
    (["compare", "--reference", "nope.safetensors", "--backend", "transformers"], "nope.safetensors: no such file"),
    (["compare", "--reference", "REF"], "give one of --backend or --candidate"),
    (["compare", "--reference", "REF", "--backend", "transformers", "--candidate", "REF"], "give one of"),
    (["compare", "--reference", "REF", "--candidate", "BAD"], "not JSON"),
    (["compare", "--reference", "REF", "--candidate", "UNKNOWN"], "unknown key 'logprob'"),
    (["compare", "--reference", "REF", "--candidate", "SHORT"], "the candidate has 1 questions, the reference 3"),
    (["compare", "--reference", "REF", "--backend", "transformers", "--backend-model", "nowhere"],
     "nowhere: not an HF directory"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--atol", "-1"], "tolerances must be >= 0: --atol -1.0"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--rtol", "nan"], "tolerances must be >= 0: --rtol nan"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--layer-rtol", "-1"], "tolerances must be >= 0: --layer-rtol"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["export", "-m", "MODEL", "--prompt-ids", "LATIN1", "-o", "x.safetensors"], "not UTF-8 text"),
    (["compare", "--reference", "REF", "--candidate", "LATIN1"], "not a readable UTF-8 text file"),
    (["export", "-m", "MODEL", "--prompt-ids", "OUT_OF_VOCAB", "-o", "x.safetensors"], "token ids must be in 0 .. 60"),
    (["export", "-m", "MODEL", "--prompt-ids", "PROMPTS", "-o", "x.bin"], "the record is a .safetensors file"),
    (["compare", "--bogus"], "unrecognized arguments: --bogus"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--device", "warp9"], "--device warp9: not a torch device"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "notaurl"], "not an http:// or https:// URL"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--layers"],
     "--layers: the reference and the candidate hold no hidden states"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "http://[::1/v1"], "not a URL"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "http://h:8000/v 1"], "holds a space"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "http://h/v1", "--timeout", "nan"],
     "--timeout: 'nan' is not a number of seconds above 0"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "http://h/v1", "--timeout", "1e10"],
     "--timeout: '1e10' is not a number of seconds above 0 and at most 10,000,000"),  # a socket's overflow
    (["compare", "--reference", "REF", "--candidate", "REF", "--timeout", "5"], "--timeout go with --backend openai"),
    (["export", "-m", "MODEL", "--prompt-ids", "EMPTY", "-o", "x.safetensors"], "an empty prompt"),
    (["export", "-m", "MODEL", "--prompt-ids", "TWICE", "-o", "x.safetensors"], "the key 'doc' is given twice"),
    (["export", "-m", "MODEL", "--prompt-ids", "NEGDOC", "-o", "x.safetensors"], "(doc >= 0)"),
    (["export", "-m", "MODEL", "--prompt-ids", "EXTRA", "-o", "x.safetensors"],
     "unknown key 'x' (a line holds prompt_ids and doc)"),
    # options nothing would read: once ignored without a word
    (["compare", "--reference", "REF", "--candidate", "REF", "-m", "MODEL"],
     "--model: --reference already holds the answers and --candidate runs no model; drop --model"),
    (["compare", "--reference", "REF", "--candidate", "REF", "-n", "4", "--dtype", "bfloat16"],
     "--max-new-tokens, --dtype: --reference already holds"),
    (["compare", "--reference", "REF", "--backend", "transformers", "--mode", "independent"],
     "--mode: --reference already holds the answers; drop --mode"),
    (["compare", "--reference", "REF", "--backend", "llama-cpp", "--backend-model", "m.gguf", "--dtype", "bfloat16"],
     "--dtype: --reference already holds the answers and the llama-cpp backend chooses its own device and dtype; "
     "drop --dtype"),
    (["compare", "--reference", "REF", "--backend", "openai", "--url", "http://h/v1", "--device", "cpu:0"],
     "--device: --reference already holds the answers and the openai backend chooses its own"),
    (["compare", "--reference", "REF", "--candidate", "REF", "-n", "16", "--device", "cpu"],  # the defaults, given
     "--max-new-tokens, --device: --reference already holds the answers and --candidate runs no model"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--timeout", "120"], "--timeout go with --backend openai"),
    (["compare", "--reference", "REF", "--candidate", "REF", "--backend-model", "MODEL"],
     "--backend-model goes with --backend"),
    # files that once gave tracebacks or lost what was beside them
    (["export", "-m", "MODEL", "--prompt-ids", "PROMPTS", "-o", "NOTES"],
     "notes.json: exists and is not a record's manifest, which export writes there"),
    (["compare", "--reference", "QUESTION_INTS", "--candidate", "REF"], "its manifest's questions must be a list of objects"),
    (["compare", "--reference", "MODEL_TEXT", "--candidate", "REF"], "its manifest's model must be an object"),
    (["compare", "--reference", "BACKEND_INT", "--candidate", "REF"], "its manifest's backend must be a string; got 5"),
    (["compare", "--reference", "COMMIT_INT", "--candidate", "REF"], "its manifest's minillama_commit must be a string"),
    (["compare", "--reference", "REF", "--candidate", "VERSIONS_LIST"], "its manifest's versions must be an object"),
    (["compare", "--reference", "REF", "--candidate", "HUGE_LOGPROB"], "logprobs must be a list of numbers"),
    # references edited, swapped or of another version: once compared as if whole
    (["compare", "--reference", "FORMAT2", "--candidate", "REF"],
     "its manifest's format is \"minillama-oracle/2\"; this minillama reads minillama-oracle/1"),
    (["compare", "--reference", "EDITED", "--candidate", "REF"],
     "the manifest's question 2: token_ids differ from the tensor q1.token_ids"),
    (["compare", "--reference", "FEWER", "--candidate", "REF"],
     "its manifest describes 2 questions, its tensors hold 3"),
    (["compare", "--reference", "MANIFEST", "--candidate", "REF"], "a record's manifest, not a record; give "),
    (["compare", "--reference", "FOLDER", "--candidate", "REF"], "is a folder"),
    (["compare", "--reference", "DEEP", "--candidate", "REF", "--json"],  # --json once recursed past the stack
     "metadata is nested more than 100 levels deep"),
    (["compare", "--reference", "QUESTIONS_OBJECT", "--candidate", "REF"],  # once read as no questions described
     "its manifest's questions must be a list of objects"),
    (["compare", "--reference", "REF", "--candidate", "OOV_ID"],
     "question 1: the candidate's token id 999999 at step 2 is outside the reference's vocabulary"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tiny, ref, tmp_path, capsys, args, message):
    _, _, path = tiny
    files = {"REF": tmp_path / "ref.safetensors", "BAD": tmp_path / "bad.jsonl", "UNKNOWN": tmp_path / "u.jsonl",
             "SHORT": tmp_path / "short.jsonl", "OUT_OF_VOCAB": tmp_path / "oov.jsonl",
             "LATIN1": tmp_path / "latin1.jsonl", "EMPTY": tmp_path / "empty.jsonl", "TWICE": tmp_path / "twice.jsonl",
             "NEGDOC": tmp_path / "negdoc.jsonl", "EXTRA": tmp_path / "extra.jsonl",
             "NOTES": tmp_path / "notes.safetensors", "QUESTION_INTS": tmp_path / "qints.safetensors",
             "MODEL_TEXT": tmp_path / "mtext.safetensors", "HUGE_LOGPROB": tmp_path / "huge.jsonl",
             **{k: tmp_path / f"{k.lower()}.safetensors" for k in ("BACKEND_INT", "COMMIT_INT", "VERSIONS_LIST")}}
    save(ref, files["REF"])
    (tmp_path / "notes.json").write_text("my notes\n")
    _rewrite_manifest(files["REF"], files["QUESTION_INTS"], questions=[1, 2, 3])
    _rewrite_manifest(files["REF"], files["MODEL_TEXT"], model="abc")
    _rewrite_manifest(files["REF"], files["BACKEND_INT"], backend=5)  # each once a traceback
    _rewrite_manifest(files["REF"], files["COMMIT_INT"], minillama_commit=12345)
    _rewrite_manifest(files["REF"], files["VERSIONS_LIST"], versions=[1])
    described = json.loads(files["REF"].with_suffix(".json").read_text())["questions"]
    _rewrite_manifest(files["REF"], tmp_path / "format2.safetensors", format="minillama-oracle/2")
    edited = copy.deepcopy(described)
    edited[1]["token_ids"][0] += 1
    _rewrite_manifest(files["REF"], tmp_path / "edited.safetensors", questions=edited)
    _rewrite_manifest(files["REF"], tmp_path / "fewer.safetensors", questions=described[:2])
    deep: list = []
    for _ in range(900):
        deep = [deep]
    _rewrite_manifest(files["REF"], tmp_path / "deep.safetensors", model={"path": None, "config": deep})
    _rewrite_manifest(files["REF"], tmp_path / "questions_object.safetensors", questions={})
    files["OOV_ID"] = tmp_path / "oov_id.jsonl"
    files["OOV_ID"].write_text("".join(json.dumps({"token_ids": q.token_ids[:2] + [999999] * (i == 0)}) + "\n"
                                       for i, q in enumerate(ref.questions)))
    files.update({k: tmp_path / f"{k.lower()}.safetensors"
                  for k in ("FORMAT2", "EDITED", "FEWER", "DEEP", "QUESTIONS_OBJECT")},
                 MANIFEST=files["REF"].with_suffix(".json"), FOLDER=tmp_path)
    files["HUGE_LOGPROB"].write_text(json.dumps({"token_ids": ref.questions[0].token_ids,
                                                 "logprobs": [10**400] + [0] * (STEPS - 1)}) + "\n")
    files["BAD"].write_text("{not json\n")
    files["UNKNOWN"].write_text('{"token_ids": [1], "logprob": [0.0]}\n')
    files["SHORT"].write_text('{"token_ids": [1]}\n')
    files["OUT_OF_VOCAB"].write_text("[1, 2, 999]\n")
    files["LATIN1"].write_bytes(b'{"token_ids": [1]} caf\xe9\n')
    files["EMPTY"].write_text("[]\n")
    files["TWICE"].write_text('{"prompt_ids": [1, 2], "doc": 0, "doc": 1}\n')
    files["NEGDOC"].write_text('{"prompt_ids": [1, 2], "doc": -1}\n')
    files["EXTRA"].write_text('{"prompt_ids": [1, 2], "x": 1}\n')
    subst = {**{k: str(v) for k, v in files.items()}, "MODEL": str(path), "PROMPTS": _write_prompts(tmp_path)}
    args = [subst.get(a, a) for a in args]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ") and message in captured.err


def test_export_again_replaces_its_own_record(tiny, tmp_path, capsys):
    """Its own manifest beside the record is replaced by a second export (a file that is not one is not)."""
    _, _, path = tiny
    out = tmp_path / "ref.safetensors"
    for _ in range(2):
        assert main(["export", "-m", str(path), "--prompt-ids", _write_prompts(tmp_path), "-n", "2", "-o", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["format"] == "minillama-oracle/1"


def test_a_failed_export_leaves_the_old_record_and_its_inputs_alone(tiny, tmp_path, capsys):
    """A manifest that could not be written (a link into a missing folder, a file that refuses writes) came after
    the record was replaced: exit 2, and the golden record was another. -o naming the model's weights or the
    prompts file overwrote them, exit 0."""
    import minillama.oracle.record as record

    _, _, path = tiny
    prompts = _write_prompts(tmp_path)
    out = tmp_path / "ref.safetensors"
    assert main(["export", "-m", str(path), "--prompt-ids", prompts, "-n", "3", "-o", str(out)]) == 0
    before = out.read_bytes(), out.with_suffix(".json").read_bytes()
    (tmp_path / "one.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    out.with_suffix(".json").unlink()
    out.with_suffix(".json").symlink_to(tmp_path / "missing" / "ref.json")
    assert main(["export", "-m", str(path), "--prompt-ids", str(tmp_path / "one.jsonl"), "-n", "3",
                 "-o", str(out)]) == 2
    assert "whose folder does not exist" in capsys.readouterr().err and out.read_bytes() == before[0]
    out.with_suffix(".json").unlink()
    out.with_suffix(".json").write_bytes(before[1])
    real = record.write_file

    def refuse_records(p, data):  # the manifest is written, then the record cannot be
        if str(p).endswith(".safetensors"):
            raise CannotWrite(Path(p), "no space left on device")
        return real(p, data)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(record, "write_file", refuse_records)
        assert main(["export", "-m", str(path), "--prompt-ids", str(tmp_path / "one.jsonl"), "-n", "3",
                     "-o", str(out)]) == 2
    assert (out.read_bytes(), out.with_suffix(".json").read_bytes()) == before  # the manifest put back
    capsys.readouterr()
    weights_file = path / "model.safetensors"
    held = weights_file.read_bytes()
    own = tmp_path / "prompts.safetensors"  # a prompts file of any name is read
    own.write_text(Path(prompts).read_text())
    for target, given in ((weights_file, prompts), (own, str(own))):
        assert main(["export", "-m", str(path), "--prompt-ids", given, "-n", "2", "-o", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "write the record elsewhere" in err, err
    assert weights_file.read_bytes() == held


def test_a_save_killed_while_writing_the_record_leaves_the_old_pair(ref, tmp_path):
    """save wrote the manifest, then the record's tensors: a run killed between (while the tensors were written,
    the slow part) left the new manifest beside the old record. The tensors now go to a temporary first."""
    out = tmp_path / "ref.safetensors"
    save(ref, out)
    before = out.read_bytes(), out.with_suffix(".json").read_bytes()
    script = ("import os, safetensors.torch\n"
              "from minillama.oracle import load, save\n"
              f"r = load({str(out)!r})\n"
              "r.questions[0].question = 'changed'\n"
              "safetensors.torch.save_file = lambda *a, **k: os._exit(9)  # killed while it writes the tensors\n"
              f"save(r, {str(out)!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 9
    assert (out.read_bytes(), out.with_suffix(".json").read_bytes()) == before


def test_equal_infinities_are_no_error_and_an_empty_stopped_reference_is_no_traceback(ref):
    """-inf against -inf (a masked token) gave NaN and "logits out of tolerance"; a reference that stopped before
    any token met a longer candidate with an IndexError."""
    r = copy.deepcopy(ref)
    r.questions[0].logits[:, 60] = -math.inf
    assert all(x.passed and x.logit_max == 0 for x in compare(r, candidate(r, logprobs=None), PRESETS["exact"]))
    c = candidate(r, logprobs=None)
    c.questions[0].logits[:, 60] = 0.0
    assert not compare(r, c)[0].passed
    r.questions[0].token_ids, r.questions[0].finish_reason = [], "stop"
    r.questions[0].logits = r.questions[0].logits[:0]
    result = compare(r, candidate(ref, logits=None, logprobs=None))[0]
    assert not result.passed and "stop, before any token" in result.reason


def test_prompt_ids_lines_end_at_newlines_only_and_export_offers_what_it_has(tiny, tmp_path, capsys):
    """--prompt-ids split at form feeds too (str.splitlines): a bad line was blamed on the next, and
    "[1, 2]\\f[3, 4]" read as two prompts. `export --tp 2` said to add --procs, which export does not take."""
    _, _, path = tiny
    p, out = tmp_path / "p.jsonl", str(tmp_path / "r.safetensors")
    for text, says in (("[1, 2]\n\x0c\n[3, 999]\n", ":3: token ids must be in"),
                       ("[1, 2]\x0c[3, 4]\n", ":1: expected a JSON list of integer token ids")):
        p.write_text(text)
        assert main(["export", "-m", str(path), "--prompt-ids", str(p), "-o", out]) == 2
        assert says in capsys.readouterr().err
    assert main(["export", "-m", str(path), "--tp", "2", "-o", out]) == 2
    err = capsys.readouterr().err
    assert "start with torchrun --nproc-per-node N" in err and "--procs" not in err, err


def test_module_entry_point_reports_bad_input_without_a_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "minillama.oracle", "compare", "--reference",
                           str(tmp_path / "missing.safetensors"), "--backend", "transformers"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'missing.safetensors'}: no such file"]


# --------------------------------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct)


@pytest.fixture(scope="module")
def default_dir():
    return weights.fetch_default()


@pytest.mark.slow
def test_default_model_agrees_with_transformers(default_dir, tmp_path, capsys):
    out = tmp_path / "ref.safetensors"
    assert main(["export", "-n", "12", "-o", str(out)]) == 0
    capsys.readouterr()
    code = main(["compare", "--reference", str(out), "--backend", "transformers", "--layers"])
    text = capsys.readouterr().out
    print(text)
    assert code == 0, text
    assert "3 of 3 questions pass: PASS" in text
    assert "every activation within tolerance" in text


@pytest.mark.slow
def test_default_model_perturbed_layer_is_named(default_dir):
    model, tok = weights.load_model(default_dir)
    from minillama.api import build_prompts
    from minillama.oracle.__main__ import EXAMPLE_DOC, EXAMPLE_QUESTIONS

    prompts, _, _ = build_prompts(tok, [(EXAMPLE_DOC, EXAMPLE_QUESTIONS[:1])])
    ref = export(model, prompts, max_new_tokens=4, eos_ids=tok.eos_ids)
    backend = TransformersBackend.load(default_dir)
    with torch.no_grad():
        backend.model.model.layers[17].mlp.down_proj.weight *= 1.01
    (r,) = check(ref, [MinillamaBackend(model).activations(prompts[0] + ref.questions[0].token_ids[:-1])], backend)
    assert not r.passed
    assert (r.layers.first_bad.layer, r.layers.first_bad.kind) == (17, "MLP")


# --------------------------------------------------------------------------------------------------
# What a candidate must give: whole answers, integer ids, numbers


def test_a_short_or_empty_answer_fails_unless_prefixes_are_allowed(ref):
    empty = candidate(ref, logits=None, logprobs=None, token_ids=[])
    assert not any(r.passed for r in compare(ref, empty))
    short = candidate(ref, logits=None, logprobs=None)
    short.questions[1].token_ids = short.questions[1].token_ids[:1]
    results = compare(ref, short)
    assert [r.passed for r in results] == [True, False, True]
    assert results[1].reason.startswith(f"the candidate answered 1 of the reference's {STEPS} steps")
    allowed = compare(ref, short, allow_prefix=True)
    assert all(r.passed for r in allowed) and "--allow-prefix" in allowed[1].notes[0]


@pytest.mark.parametrize("line, message", [
    ('{"token_ids": [504.9]}', "token_ids must be a list of integers; got 504.9"),
    ('{"token_ids": [504.0]}', "token_ids must be a list of integers; got 504.0"),
    ('{"token_ids": ["504"]}', 'token_ids must be a list of integers; got "504"'),
    ('{"token_ids": [true]}', "token_ids must be a list of integers; got true"),
    ('{"token_ids": 5}', "token_ids must be a list of integers"),
    ('{"token_ids": [1], "logprobs": ["-0.5"]}', "logprobs must be a list of numbers"),
    ('{"token_ids": [1], "logits": [[1, 2], [3]]}', "logits must be a list of lists of numbers"),
    ('{"token_ids": [1], "prompt_ids": [1.5]}', "prompt_ids must be a list of integers"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_malformed_candidate_values_are_bad_input(ref, tmp_path, capsys, line, message):
    save(ref, tmp_path / "ref.safetensors")
    (tmp_path / "c.jsonl").write_text(line + "\n")
    assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--candidate",
                 str(tmp_path / "c.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_float_token_ids_in_a_safetensors_candidate_are_bad_input(ref, tmp_path, capsys):
    from safetensors.torch import save_file

    save(ref, tmp_path / "ref.safetensors")
    for dtype in (torch.float32, torch.complex64):  # complex: once a TypeError
        tensors = {f"q{i}.token_ids": torch.tensor(q.token_ids, dtype=dtype) for i, q in enumerate(ref.questions)}
        save_file(tensors, str(tmp_path / "c.safetensors"))
        assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--candidate",
                     str(tmp_path / "c.safetensors")]) == 2
        assert "q0.token_ids must be a 1-D integer tensor" in capsys.readouterr().err



@pytest.mark.parametrize("bad", [-5, 2**63 - 1])
def test_a_reference_token_id_outside_the_vocabulary_is_bad_input(ref, tmp_path, capsys, bad):
    """A negative id read the logits row from its end: the step passed as a "near tie" against the true token."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    save(ref, tmp_path / "ref.safetensors")
    tensors = load_file(str(tmp_path / "ref.safetensors"))
    tensors["q0.token_ids"][0] = bad
    with safe_open(str(tmp_path / "ref.safetensors"), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata=meta)
    candidate_rows = [{"token_ids": q.token_ids, "logprobs": q.logprobs.tolist()} for q in ref.questions]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in candidate_rows))
    assert main(["compare", "--reference", str(tmp_path / "bad.safetensors"), "--candidate",
                 str(tmp_path / "c.jsonl")]) == 2
    err = capsys.readouterr().err
    vocab = ref.questions[0].logits.shape[1]
    assert err.count("\n") == 1 and f"question 1: token_ids must be in 0 .. {vocab - 1}" in err and str(bad) in err

def test_deeply_nested_prompt_ids_are_one_line(tiny, tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n")
    assert main(["export", "-m", str(tiny[2]), "--prompt-ids", str(tmp_path / "p.jsonl"),
                 "-o", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected a JSON list of integer token ids" in err


def test_export_checks_its_output_folder_before_running_the_model(tiny, tmp_path, capsys, monkeypatch):
    import minillama.oracle.__main__ as cli

    monkeypatch.setattr(cli, "_make_reference", lambda *a, **k: pytest.fail("the model ran"))
    assert main(["export", "-m", str(tiny[2]), "--prompt-ids", _write_prompts(tmp_path),
                 "-o", str(tmp_path / "missing" / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the folder {tmp_path / 'missing'} does not exist" in err


def test_a_bug_is_not_reported_as_bad_input(ref, tmp_path, monkeypatch):
    import minillama.oracle.__main__ as cli

    save(ref, tmp_path / "ref.safetensors")

    def broken(*a, **k):
        raise ValueError("an internal bug")

    monkeypatch.setattr(cli, "compare", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--candidate",
              str(tmp_path / "ref.safetensors")])


# --------------------------------------------------------------------------------------------------
# Presets and hints


def test_presets_set_logit_and_logprob_tolerances_together(tiny, tmp_path, capsys):
    out = tmp_path / "ref.safetensors"
    assert main(["export", "-m", str(tiny[2]), "--prompt-ids", _write_prompts(tmp_path), "-n", "4",
                 "-o", str(out)]) == 0
    capsys.readouterr()

    def run(*extra):
        code = main(["compare", "--reference", str(out), "--backend", "transformers", "--json", *extra])
        return code, json.loads(capsys.readouterr().out)

    code, got = run()  # transformers: fp32 by default
    assert code == 0 and got["tolerances"]["preset"] == "fp32" and got["tolerances"]["atol"] == 1e-4
    code, got = run("--preset", "exact")  # HF's last bits differ from minillama's
    assert code == 1 and got["tolerances"]["logprob_atol"] == 0.0
    code, got = run("--preset", "quantized", "--atol", "0.5")
    t = got["tolerances"]
    assert code == 0 and (t["atol"], t["logprob_atol"]) == (0.5, 1.5) and t["preset"] == "quantized with --atol set"
    # A minillama record against itself gets the exact preset, and passes it.
    assert main(["compare", "--reference", str(out), "--candidate", str(out)]) == 0
    assert "tolerance  preset exact:" in capsys.readouterr().out
    # One exported at other product units holds other bits: fp32, not exact (once exact, and failed).
    one = tmp_path / "one.safetensors"
    assert main(["export", "-m", str(tiny[2]), "--prompt-ids", _write_prompts(tmp_path), "-n", "4", "--units", "1",
                 "-o", str(one)]) == 0
    capsys.readouterr()
    assert main(["compare", "--reference", str(out), "--candidate", str(one)]) == 0
    assert "tolerance  preset fp32:" in capsys.readouterr().out


@pytest.mark.parametrize("noise, constant, hint", [
    (0.0, False, None),
    (2e-3, False, "half-precision rounding"),
    (0.3, False, "quantized weights"),
    (8.0, False, "a bug"),
    (0.5, True, "shifted by a constant"),
    (float("nan"), False, "NaN or inf values, a numerical fault"),
])
def test_hints_follow_the_pattern_of_the_errors(ref, noise, constant, hint):
    from minillama.oracle.diff import Comparison, hints

    c = candidate(ref)
    g = torch.Generator().manual_seed(0)
    for q in c.questions:
        shape = (q.logits.shape[0], 1) if constant else q.logits.shape
        q.logits = q.logits + noise * torch.rand(shape, generator=g)
    got = hints(Comparison({}, {}, Tolerances(), compare(ref, c, PRESET_LOOSE)))
    if hint is None:
        assert got == []
    else:
        assert len(got) == 1 and hint in got[0], got


PRESET_LOOSE = Tolerances(100.0, 0.0, 100.0, 0.0)


# --------------------------------------------------------------------------------------------------
# The HTTP backend's reading of the completions API (the real llama.cpp server: test_oracle_llamacpp.py)


class _Completions:
    """A minimal completions endpoint over a minillama model, answering as the OpenAI API describes: with
    echo, every prompt token's log-prob given the tokens before it (the first one null), then one generated
    token. `late` shifts the log-probs by one position, `no_logprobs` leaves them out."""

    def __init__(self, model, late=False, no_logprobs=False):
        self.model, self.late, self.no_logprobs = model, late, no_logprobs

    def answer(self, body):
        ids, k = body["prompt"], body["logprobs"]
        lp = torch.log_softmax(MinillamaBackend(self.model).logits(ids), dim=-1)  # row t predicts token t + 1
        nxt = int(lp[-1].argmax())
        rows = [None] + [lp[t - 1] for t in range(1, len(ids))] + [lp[-1]]
        if self.late:
            rows = [None, None] + rows[1:-1]
        toks = ids + [nxt]
        token_lps = [None if r is None else float(r[t]) for r, t in zip(rows, toks)]
        tops = [None if r is None else {f"token_id:{int(i)}": float(r[i]) for i in r.topk(k).indices} for r in rows]
        logprobs = None if self.no_logprobs else {"token_logprobs": token_lps, "top_logprobs": tops,
                                                  "tokens": [str(t) for t in toks]}
        return {"choices": [{"index": 0, "text": "", "logprobs": logprobs, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}


@contextlib.contextmanager
def _serving():
    """A stand-in completions server; on leaving, no request of it is still being handled.

    A handler that outlives its test (one planted to hang past the client's timeout) wrote a socketserver
    traceback into whichever test's stderr was captured when it woke: a test that counts the lines of its
    own error message then failed by chance. So a hang waits on `state["closing"]`, the handlers are joined
    on the way out, and a client that gave up and left is not an error worth printing.
    """
    import http.server
    import threading

    state = {"closing": threading.Event()}

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, obj, status=200):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(state.get("models", {"data": [{"id": "tiny"}]}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            got = state["server"].answer(body)
            self.reply(*got[::-1]) if isinstance(got, tuple) else self.reply(got)  # (status, body): a refusal

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = False  # so that server_close() joins every handler

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # the client timed out and left
                super().handle_error(request, client_address)

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield state, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        state["closing"].set()
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def completions_server():
    with _serving() as served:
        yield served


def test_a_reference_from_weights_alone_checks_a_server(tiny, ref, completions_server, tmp_path, capsys):
    """A record exported from a folder of weights without a tokenizer (token-id prompts need none) was refused
    by --backend openai ("missing tokenizer"), and a --model that did not exist was passed over in silence."""
    state, url = completions_server
    state["server"] = _Completions(tiny[1])
    save(ref, tmp_path / "ref.safetensors")
    args = ["compare", "--reference", str(tmp_path / "ref.safetensors"), "--backend", "openai", "--url", url]
    assert main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(args + ["-m", str(tmp_path / "nothing")]) == 2
    assert "--model " + str(tmp_path / "nothing") + ": no such file or directory" in capsys.readouterr().err


def test_openai_backend_reads_echoed_logprobs(tiny, ref, completions_server):
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Completions(tiny[1])
    backend = OpenAIBackend(url)
    assert backend.model == "tiny"
    results = compare(ref, run_backend(ref, backend), Tolerances(preset="fp32"))
    assert all(r.passed for r in results), [r.reason for r in results]
    assert all(r.top_k_overlap == 1.0 and r.logprob_max < 1e-5 and r.first_divergence is None for r in results)

    state["server"] = _Completions(tiny[1], late=True)  # each log-prob one position late
    results = compare(ref, run_backend(ref, backend))
    assert not any(r.passed for r in results)
    assert all("out of tolerance from step 0" in r.reason for r in results)

    state["server"] = _Completions(tiny[1], no_logprobs=True)
    with pytest.raises(BackendError, match="returned no prompt log-probs"):
        run_backend(ref, backend)



class _Garbage:
    """A server whose answers have another shape than the API's (`mangle` edits a true answer)."""

    def __init__(self, tok, mangle):
        self.true, self.mangle = _Completions(tok), mangle

    def answer(self, body):
        got = self.true.answer(body)
        self.mangle(got)
        return got


class _Strict(_Completions):
    """A server that refuses fields it does not know, as some do, and names tokens by their text."""

    def __init__(self, model):
        super().__init__(model)
        self.asked = []

    def answer(self, body):
        self.asked.append("return_tokens_as_token_ids" in body)
        if "return_tokens_as_token_ids" in body:
            return 400, {"error": {"message": "return_tokens_as_token_ids: extra inputs are not permitted"}}
        got = super().answer(body)
        lp = got["choices"][0]["logprobs"]
        lp["top_logprobs"] = [top and {f"t{k[9:]}": v for k, v in top.items()}  # token_id:N -> tN, one token's text
                              for top in lp["top_logprobs"]]
        return got


def test_top_tokens_are_asked_by_id_and_by_text_where_the_server_refuses_that(tiny, ref, completions_server):
    """The backend asks for the top-k by id (return_tokens_as_token_ids); a server that refuses the field is
    asked once, then never again, and its texts name the tokens: the same verdicts."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Completions(tiny[1])
    asked = []
    state["server"].answer = lambda body, answer=state["server"].answer: asked.append(body) or answer(body)
    results = compare(ref, run_backend(ref, OpenAIBackend(url)), Tolerances(preset="fp32"))
    assert all(r.passed and r.top_k_overlap == 1.0 for r in results)
    assert asked and all(b.get("return_tokens_as_token_ids") is True for b in asked)
    state["server"] = strict = _Strict(tiny[1])
    vocab = [f"t{i}" for i in range(tiny[1].config.vocab_size)]
    results = compare(ref, run_backend(ref, OpenAIBackend(url, vocab=vocab)), Tolerances(preset="fp32"))
    assert all(r.passed and r.top_k_overlap == 1.0 for r in results), [r.reason for r in results]
    assert strict.asked[0] and not any(strict.asked[1:]) and len(strict.asked) == len(ref.questions) + 1


@pytest.mark.parametrize("mangle, message", [
    (lambda g: g.update(choices=["x"]), "no choices in the answer"),
    (lambda g: g.pop("choices"), "no choices in the answer"),
    (lambda g: g["choices"][0].update(logprobs=[1]), "choices[0].logprobs must be an object"),
    (lambda g: g["choices"][0]["logprobs"].update(token_logprobs=["-1"] * 9), "token_logprobs must be a list of num"),
    (lambda g: g["choices"][0]["logprobs"].update(top_logprobs=[["a"]] * 9), "top_logprobs must be a list of objects"),
    (lambda g: g["choices"][0]["logprobs"].update(top_logprobs=[{"a": "-1"}] * 9), "top_logprobs must be a list of"),
    (lambda g: g.update(usage=[1]), "usage must be an object of integer token counts"),
    (lambda g: g["usage"].update(completion_tokens="1"), "usage must be an object of integer token counts"),
    (lambda g: g["choices"][0]["logprobs"].update(top_logprobs=[{"token_id:99999999999": 0.0}] * len(
        g["choices"][0]["logprobs"]["top_logprobs"])), "token_id:99999999999, past any vocabulary"),
    # each top-k once read at the wrong step (aligned from the end): failed as a numeric error, or passed
    (lambda g: g["choices"][0]["logprobs"]["top_logprobs"].pop(0), "top_logprobs and token_logprobs differ in length"),
    (lambda g: g["choices"][0]["logprobs"].update(top_logprobs=[{"a": -1.0}]), "differ in length (1 and "),
    (lambda g: g.update(error={"message": "model overloaded"}), "an error in an answer of HTTP 200: model overloaded"),
    # choices that cannot say which is the one asked for (index 0) were read by their place: choices[0]
    (lambda g: g["choices"][0].pop("index"), "choices must each have their own integer index, one of them 0 "
                                             "(got indexes [null])"),
    (lambda g: g["choices"][0].update(index=1), "(got indexes [1])"),
    (lambda g: g["choices"][0].update(index=True), "(got indexes [true])"),
    (lambda g: g["choices"][0].update(index="0"), '(got indexes ["0"])'),
    (lambda g: g.update(choices=g["choices"] * 2), "(got indexes [0, 0])"),
    # one echoed entry more or less than the tokens sent was read aligned from the end, each log-prob beside
    # the next token or the one before
    (lambda g: [g["choices"][0]["logprobs"][k].insert(0, None) for k in ("token_logprobs", "top_logprobs")],
     "echoed log-probs (1 generated) for a prompt and answer of"),
    (lambda g: [g["choices"][0]["logprobs"][k].pop(0) for k in ("token_logprobs", "top_logprobs")],
     "echoed log-probs (1 generated) for a prompt and answer of"),
])
def test_a_malformed_server_answer_is_named_in_one_line(tiny, ref, completions_server, mangle, message):
    """Each once crashed the comparison (AttributeError, TypeError, ValueError, OverflowError)."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Garbage(tiny[1], mangle)
    with pytest.raises(BackendError, match=re.escape(message)):
        run_backend(ref, OpenAIBackend(url))


def test_the_choice_of_index_0_is_read_wherever_it_stands(tiny, ref, completions_server):
    """The backend read choices[0]: a server that lists another choice first was judged by that choice."""
    from minillama.oracle.server import OpenAIBackend

    def other_first(got):
        right = got["choices"][0]
        lp = right["logprobs"]
        late = {k: [None] + lp[k][:-1] for k in ("token_logprobs", "top_logprobs")}  # each a position late
        got["choices"] = [{**right, "index": 1, "logprobs": {**lp, **late}}, right]

    state, url = completions_server
    state["server"] = _Garbage(tiny[1], other_first)
    results = compare(ref, run_backend(ref, OpenAIBackend(url)), Tolerances(preset="fp32"))
    assert all(r.passed and r.logprob_max < 1e-5 for r in results), [r.reason for r in results]


@pytest.mark.parametrize("listed, shown", [(None, "null"), (7, "7"), ("", '""'), (["m"], '["m"]')])
def test_a_model_id_that_is_no_name_is_refused(completions_server, listed, shown):
    """A null or a number as /models' first id was sent on as the model's name (null: as no model)."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["models"] = {"data": [{"id": listed}]}
    with pytest.raises(BackendError, match=re.escape(f"{url}/models: a malformed answer: data[0].id is {shown}, "
                                                     "not a model's name; give the server's model name with "
                                                     "--backend-model")):
        OpenAIBackend(url)
    state["models"] = {"data": [{"id": "tiny"}]}
    assert OpenAIBackend(url).model == "tiny"


def test_a_malformed_model_id_is_one_line_and_exit_2(ref, tmp_path, completions_server, capsys):
    state, url = completions_server
    state["models"] = {"data": [{"id": None}]}
    no_tokenizer = {**ref.manifest, "model": {**ref.manifest["model"], "path": None}}  # the tiny model has none
    save(Record(ref.questions, no_tokenizer), tmp_path / "ref.safetensors")
    assert main(["compare", "--reference", str(tmp_path / "ref.safetensors"), "--backend", "openai",
                 "--url", url]) == 2
    assert capsys.readouterr().err == (f"error: {url}/models: a malformed answer: data[0].id is null, not a model's "
                                       "name; give the server's model name with --backend-model\n")


class _TextOnly(_Completions):
    """A server that takes text prompts only, as llama-cpp-python's does: its tokenizer reads the numbers the
    backend's `decode` below writes, `extra` added in front; `usage` sent or not, and, with `no_bos`, the
    echo of a prompt that starts with `no_bos` without that first entry."""

    def __init__(self, model, usage=True, extra=(), no_bos=None):
        super().__init__(model)
        self.usage, self.extra, self.no_bos = usage, list(extra), no_bos

    def answer(self, body):
        if not isinstance(body["prompt"], str):
            return 400, {"error": {"message": "prompt: a string is required"}}
        ids = self.extra + [int(t) for t in body["prompt"].split()]
        got = super().answer({**body, "prompt": ids})
        if not self.usage:
            del got["usage"]
        if ids[0] == self.no_bos:
            for key in ("token_logprobs", "top_logprobs", "tokens"):
                del got["choices"][0]["logprobs"][key][0]
        return got


def _text_backend(url, bos=None):
    from minillama.oracle.server import OpenAIBackend

    return OpenAIBackend(url, decode=lambda ids: " ".join(map(str, ids)), **({} if bos is None else {"bos": bos}))


def test_a_prompt_sent_as_text_is_checked_without_usage(tiny, ref, completions_server):
    """With text prompts and no usage, the server's token count went unchecked: a tokenizer that made one
    token more passed, every log-prob read beside another token. The echo's length now counts them."""
    state, url = completions_server
    fp32, n = Tolerances(preset="fp32"), len(ref.questions[0].prompt_ids) + len(ref.questions[0].token_ids)
    for server in (_TextOnly(tiny[1]), _TextOnly(tiny[1], usage=False)):
        state["server"] = server
        results = compare(ref, run_backend(ref, _text_backend(url)), fp32)
        assert all(r.passed and not r.notes for r in results), [(r.reason, r.notes) for r in results]
    state["server"] = _TextOnly(tiny[1], extra=[1])
    with pytest.raises(BackendError, match=f"its tokenizer made {n + 1} tokens of the prompt's text where the "
                                           f"reference has {n}: it would compare other tokens"):
        run_backend(ref, _text_backend(url))
    state["server"] = _TextOnly(tiny[1], usage=False, extra=[1])
    with pytest.raises(BackendError, match=re.escape(f"{n + 2} echoed log-probs (1 generated) for a prompt and answer "
                                                     f"of {n} tokens, the prompt sent as text: its tokenizer made "
                                                     "other tokens")):
        run_backend(ref, _text_backend(url))


def test_an_echo_without_its_leading_bos_is_read(tiny, ref, completions_server):
    """A server may leave a leading BOS out of its echo: read where the prompt starts with the model's BOS,
    refused otherwise. Without usage, a tokenizer that made one token fewer reads alike: the report says so."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    fp32, bos = Tolerances(preset="fp32"), ref.questions[0].prompt_ids[0]  # questions 1 and 2 start with it
    state["server"] = _TextOnly(tiny[1], no_bos=bos)
    results = compare(ref, run_backend(ref, _text_backend(url, bos)), fp32)
    assert all(r.passed and not r.notes for r in results), [(r.reason, r.notes) for r in results]
    state["server"] = _Garbage(tiny[1], lambda g: [g["choices"][0]["logprobs"][k].pop(0)
                                                   for k in ("token_logprobs", "top_logprobs")])
    for other in (None, bos + 1):
        with pytest.raises(BackendError, match=re.escape("echoed log-probs (1 generated) for a prompt and answer")):
            run_backend(ref, OpenAIBackend(url, bos=other))
    state["server"] = _TextOnly(tiny[1], usage=False, no_bos=bos)
    results = compare(ref, run_backend(ref, _text_backend(url, bos)), fp32)
    assert all(r.passed for r in results), [r.reason for r in results]
    unchecked = ("the server sent no usage.prompt_tokens and echoed the prompt's text without its BOS: that its "
                 "tokenizer made the reference's {} tokens of it could not be checked")
    assert [r.notes for r in results] == [[unchecked.format(len(q.prompt_ids) + len(q.token_ids))]
                                          for q in ref.questions[:2]] + [[]]


class _SkipsSome(_Completions):
    """A server whose echo leaves out some prompt entries (`skip`: positions in the prompt), as llama-cpp-python's
    leaves out special tokens while its usage counts them, naming each echoed token by its text (`<N>`)."""

    def __init__(self, model, skip, names=lambda t: f"<{t}>"):
        super().__init__(model)
        self.skip, self.names = skip, names

    def answer(self, body):
        got = super().answer(body)
        lp = got["choices"][0]["logprobs"]
        lp["tokens"] = [self.names(int(t)) for t in lp["tokens"]]
        for key in ("token_logprobs", "top_logprobs", "tokens"):
            lp[key] = [x for i, x in enumerate(lp[key]) if i not in self.skip]
        return got


def test_an_echo_that_leaves_tokens_out_is_read_by_the_answers_texts(tiny, ref, completions_server):
    """llama-cpp-python's server echoed 87 entries for 90 tokens sent, usage saying 90: read from the end, its
    answer's log-probs were right, but a count alone cannot tell that echo from one of other tokens. Where the
    server names its echoed tokens, the answer's texts at the echo's end place it (a note says so); where they
    differ, or nothing names them, it is refused."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    vocab = [f"<{i}>" for i in range(tiny[1].config.vocab_size)]
    state["server"] = _SkipsSome(tiny[1], skip={1, 3})
    results = compare(ref, run_backend(ref, OpenAIBackend(url, vocab=vocab)), Tolerances(preset="fp32"))
    assert all(r.passed and r.top_k_overlap == 1.0 for r in results), [r.reason for r in results]
    n = [len(q.prompt_ids) + len(q.token_ids) for q in ref.questions]
    assert [r.notes for r in results] == [[f"the server echoed {k - 2} entries for the {k} tokens sent (its echo "
                                           f"leaves some out); the answer's {len(q.token_ids)} were found at the "
                                           "echo's end by their texts"] for k, q in zip(n, ref.questions)]
    for server, names in ((_SkipsSome(tiny[1], skip={1, 3}, names=lambda t: f"<{t + 1}>"), vocab),  # other tokens
                          (_SkipsSome(tiny[1], skip={1, 3}), None)):  # nothing to read the names by
        state["server"] = server
        with pytest.raises(BackendError, match=re.escape("echoed log-probs (1 generated) for a prompt and answer")):
            run_backend(ref, OpenAIBackend(url, vocab=names))


def test_both_clients_say_an_error_sent_with_http_200_alike(tiny, ref, completions_server):
    """The oracle's client (urllib) and serve's checks' (httpx) each found such an error, and worded it apart:
    the error's message, and the error's JSON. One rule and one wording now (minillama/refusal.py)."""
    import httpx

    from minillama.oracle.server import OpenAIBackend
    from minillama.serve.client import Refused, ask

    state, url = completions_server
    state["server"] = _Garbage(tiny[1], lambda g: g.update(error={"message": "model\n overloaded", "code": 503}))
    said = "an error in an answer of HTTP 200: model overloaded"
    with pytest.raises(BackendError) as oracle:
        run_backend(ref, OpenAIBackend(url))
    with httpx.Client() as client, pytest.raises(Refused) as serve:
        ask(client, url, "/completions", {"prompt": [5, 6, 7], "logprobs": 1, "max_tokens": 1})
    assert (str(oracle.value), str(serve.value)) == (f"{url}/completions: {said}", said)


def test_a_top_token_named_by_a_digit_int_refuses_is_a_text():
    from minillama.oracle.server import _id_of

    assert _id_of("token_id:\u00b2", {"a": 3}, "http://h/v1") == -1  # "²".isdigit(): int() raised ValueError
    assert _id_of("token_id:42", {}, "http://h/v1") == 42


def test_a_top_token_id_past_the_vocabulary_is_named(tiny, ref, completions_server):
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Garbage(tiny[1], lambda g: g["choices"][0]["logprobs"].update(
        top_logprobs=[{"token_id:99999999": 0.0}] * len(g["choices"][0]["logprobs"]["token_logprobs"])))
    with pytest.raises(RecordError, match="top log-probs name token id 99999999, outside the vocabulary"):
        compare(ref, run_backend(ref, OpenAIBackend(url)))

@pytest.mark.parametrize("value, reason", [(float("nan"), "top-5 log-probs hold NaN or +inf from step 0"),
                                           (float("inf"), "top-5 log-probs hold NaN or +inf from step 0"),
                                           (float("-inf"), "top-5 out of tolerance from step 0")])
def test_top_logprobs_that_are_not_finite_fail(tiny, ref, completions_server, value, reason):
    """A server's top-k log-probs of NaN or +/-inf (the chosen tokens' right) once passed: non-finite values
    were left out of the comparison, and a +inf best was a near tie."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Garbage(tiny[1], lambda g: g["choices"][0]["logprobs"].update(top_logprobs=[
        None if t is None else {k: value for k in t} for t in g["choices"][0]["logprobs"]["top_logprobs"]]))
    results = compare(ref, run_backend(ref, OpenAIBackend(url)), Tolerances(preset="fp32"))
    assert not any(r.passed for r in results) and all(reason in r.reason for r in results), [r.reason for r in results]


def test_openai_backend_names_a_server_that_is_not_there():
    from minillama.oracle.server import OpenAIBackend

    with pytest.raises(BackendError, match="cannot reach the server"):
        OpenAIBackend("http://127.0.0.1:9/v1", timeout=5)


class _Hangs:
    def __init__(self, closing):
        self.closing = closing

    def answer(self, body):
        self.closing.wait(3)
        return {}


def test_a_server_that_does_not_answer_is_named_after_timeout(ref, completions_server):
    """A server that hangs was waited on 120 s (no option), then called unreachable: "cannot reach the server"."""
    from minillama.oracle.server import OpenAIBackend

    state, url = completions_server
    state["server"] = _Hangs(state["closing"])
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=re.escape(f"{url}/completions: no answer within 0.5 s (--timeout)")):
        run_backend(ref, OpenAIBackend(url, timeout=0.5))
    assert time.monotonic() - t0 < 3


def test_the_stand_in_server_leaves_nothing_running_to_print_into_later_tests(ref, capfd):
    """Its hung handler used to wake 3 s later, in another test, and print a traceback there."""
    import threading

    from minillama.oracle.server import OpenAIBackend

    before = set(threading.enumerate())
    with _serving() as (state, url):
        state["server"] = _Hangs(state["closing"])
        with pytest.raises(BackendError, match="no answer within"):
            run_backend(ref, OpenAIBackend(url, timeout=0.5))
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert left == [], left
    assert capfd.readouterr().err == ""


def test_a_golden_file_comparison_loads_no_model_and_no_model_library(ref, tmp_path):
    """`compare --reference --candidate` is what another backend's CI runs: torch and safetensors only."""
    save(ref, tmp_path / "ref.safetensors")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"token_ids": q.token_ids}) + "\n" for q in ref.questions))
    code = ("import sys\nfrom minillama.oracle.__main__ import main\n"
            f"code = main(['compare', '--reference', {str(tmp_path / 'ref.safetensors')!r}, '--candidate', "
            f"{str(tmp_path / 'c.jsonl')!r}])\n"
            "heavy = {'transformers', 'llama_cpp', 'gguf', 'tokenizers', 'jinja2', 'sentencepiece'}\n"
            "print(code, sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.stdout.strip().splitlines()[-1] == "0 []", proc.stdout + proc.stderr


def test_export_reads_a_document_and_questions_as_the_command_line_does(tmp_path, capsys):
    """An empty document was answered, and a U+2028 inside a question made two (a line ends at "\\n" only)."""
    from _serve_harness import write_checkpoint

    path = write_checkpoint(tmp_path / "tiny")
    (tmp_path / "doc.txt").write_text("The sky is blue.\n")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "q.txt").write_text("What colour\u2028is the sky?\nWhy?\n")
    out = tmp_path / "ref.safetensors"
    base = ["export", "-m", str(path), "--questions", str(tmp_path / "q.txt"), "-n", "2", "-o", str(out)]
    assert main([*base, "--doc", str(tmp_path / "empty.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the document is empty" in err, err
    assert main([*base, "--doc", str(tmp_path / "doc.txt")]) == 0
    assert [q.question for q in load(out).questions] == ["What colour\u2028is the sky?", "Why?"]


def test_export_without_model_writes_over_no_file_of_the_default_model(tiny, tmp_path, capsys, monkeypatch):
    """Without --model the guard against writing over the model's files did not run: -o naming the default
    model's weights replaced them with the record (exit 0), and every later command failed on that folder."""
    _, _, path = tiny
    default = tmp_path / "w" / weights.DEFAULT_MODEL_NAME
    shutil.copytree(path, default)
    monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", str(tmp_path / "w"))
    held = (default / "model.safetensors").read_bytes()
    target = default / "model.safetensors"
    assert main(["export", "--prompt-ids", _write_prompts(tmp_path), "-n", "2", "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model (default)" in err and "write the record elsewhere" in err, err
    assert (default / "model.safetensors").read_bytes() == held and not (default / "model.json").exists()


def test_hidden_states_of_answers_one_the_others_start_are_compared_over_the_shorter(tiny):
    """Two records whose answers differ only in length (exports at -n 8 and -n 5) hold hidden states over
    different numbers of rows; --layers cut both to the prompt plus the shorter answer, one row past the
    shorter record's rows, and refused them as of other shapes."""
    _, model, _ = tiny
    long, short = (export(model, PROMPTS[:1], max_new_tokens=n, hidden=True) for n in (8, 5))
    assert long.questions[0].token_ids[:5] == short.questions[0].token_ids
    for r, c in ((long, short), (short, long)):
        (d,) = diff_hidden(r, c, Tolerances())
        assert d.first_bad is None


def test_a_record_with_an_empty_prompt_is_refused(ref, tmp_path):
    """An empty prompt_ids was taken, and teacher forcing read the row before the first (-1) as step 0: a false
    'logits out of tolerance' report rather than a refusal of the file."""
    r = copy.deepcopy(ref)
    r.questions[1].prompt_ids = []
    save(r, tmp_path / "r.safetensors")
    with pytest.raises(RecordError, match="question 2.*prompt_ids is empty"):
        load(tmp_path / "r.safetensors")


def test_a_backend_is_not_run_on_an_empty_prompt(tiny, ref):
    """A record made in Python is not loaded: run_backend took an empty prompt_ids and teacher forcing read row -1
    as step 0, a false 'logits out of tolerance' report."""
    r = copy.deepcopy(ref)
    r.questions[1].prompt_ids = []
    with pytest.raises(RecordError, match="question 2: prompt_ids is empty"):
        run_backend(r, MinillamaBackend(tiny[1]))


def test_manifest_strings_holding_brackets_are_written_as_given(ref, tmp_path):
    """save kept each list of token ids on one line by rewriting the manifest's text, strings included: a
    question '[1,2]' was written '[1, 2]' in the .json (not in the record), and '[ , ]' raised a JSONDecodeError
    after the model had run."""
    r = copy.deepcopy(ref)
    texts = ["What does [1,2] mean?", "Is [ , ] a list?", "[-] and [1,] and [ ]"]
    for q, text in zip(r.questions, texts):
        q.question = text
    save(r, tmp_path / "r.safetensors")
    manifest = json.loads((tmp_path / "r.json").read_text())
    assert [q["question"] for q in manifest["questions"]] == texts
    assert [q.question for q in load(tmp_path / "r.safetensors").questions] == texts
    assert f'"prompt_ids": {json.dumps(PROMPTS[0])}' in (tmp_path / "r.json").read_text()  # still on one line
