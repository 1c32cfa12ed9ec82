"""No silently wrong answer and no traceback for bad input: configs read as HF reads them (defaults, tied
heads), the API checks what the CLI checks, every bad config value is refused naming its field, a tiny
temperature samples, and refusing a long document costs one pass at most (writes, streams and the
tools' exit statuses: tests/test_faults_io.py).

Each class of fault is held by a parametrized test over every place of that kind: every config field
HF defaults, every bad config value, every API option and input.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ckpt_writers import byte_bpe_tokenizer, random_state_dict, tiny_config as ckpt_config  # noqa: E402
from _faults import ckpt, inputs, one_line_error, run_tool  # noqa: E402,F401  (fixtures)
from minillama import api, checks, cli  # noqa: E402
from minillama.config import LlamaConfig  # noqa: E402
from minillama.tokenizer import HFTokenizer  # noqa: E402
from minillama.weights import WeightsError, hf_config, load_model, save_hf_dir  # noqa: E402
from test_api import DOC, QUESTIONS, tiny_loaded  # noqa: E402

# --- silently wrong: config defaults and tied heads, as HF reads them ------------------------------------

HF_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
             "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id",
             "model_type", "attention_bias", "mlp_bias", "sliding_window"]


def _hf_value(hc, field: str):
    if field == "rope_theta":
        return hc.rope_parameters["rope_theta"]
    if field == "rope_scaling":  # HF's "default" rope type is no scaling
        rp = {k: v for k, v in hc.rope_parameters.items() if k != "rope_theta"}
        return None if rp.get("rope_type", "default") == "default" else rp
    return getattr(hc, field, None)  # a Llama has no sliding_window field: no window


def test_every_config_field_defaults_as_transformers_llamaconfig():
    import dataclasses

    import transformers

    ours = LlamaConfig()
    assert {f.name for f in dataclasses.fields(LlamaConfig)} == set(HF_FIELDS)  # a new field joins the test
    hf = transformers.LlamaConfig()
    for field in HF_FIELDS:
        assert getattr(ours, field) == _hf_value(hf, field), field


@pytest.mark.parametrize("field", HF_FIELDS)
def test_a_config_json_without_a_field_reads_as_transformers_reads_it(tmp_path, field):
    import transformers

    d = {**ckpt_config(vocab=320).to_dict(), "rope_theta": 50000.0}
    d.pop(field, None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = hf_config(tmp_path / "config.json")
    hf = transformers.LlamaConfig.from_json_file(str(tmp_path / "config.json"))
    assert getattr(ours, field) == _hf_value(hf, field)


@pytest.mark.parametrize("key", ["rope_type", "type"])
def test_rope_parameters_read_as_transformers_reads_them(tmp_path, key):
    """rope_parameters spelled with "type" (as rope_scaling may be, and transformers takes either) lost its
    scaling: positions rotated as if unscaled, without a word."""
    import transformers

    from minillama.rope import inv_frequencies

    d = {**ckpt_config(vocab=320).to_dict(), "rope_parameters": {key: "linear", "factor": 4.0, "rope_theta": 5e4}}
    d.pop("rope_scaling", None), d.pop("rope_theta", None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = hf_config(tmp_path / "config.json")
    hf = transformers.LlamaConfig.from_json_file(str(tmp_path / "config.json"))
    assert hf.rope_parameters["rope_type"] == "linear"
    assert ours.rope_theta == 5e4 and ours.rope_scaling is not None
    unscaled = inv_frequencies(dataclasses.replace(ours, rope_scaling=None))
    assert torch.equal(inv_frequencies(ours), unscaled / 4.0)


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},  # its theta, not the top-level one
    {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},
    {"rope_parameters": {"rope_type": "linear", "type": "dynamic", "factor": 4.0, "rope_theta": 5e4}},
    {"rope_parameters": {"type": "dynamic", "rope_type": "linear", "factor": 4.0, "rope_theta": 5e4}},
    {"rope_scaling": {}, "rope_theta": 5e4},
    {"partial_rotary_factor": 0.5, "rope_theta": 5e4},  # HF's Llama reads it only beside a scaling
], ids=["scaling-theta", "default-theta", "rope_type-first", "type-first", "empty", "partial-default"])
def test_rope_dicts_read_as_transformers_reads_them(tmp_path, rope):
    """A theta inside rope_scaling was ignored (the top-level one ran: logits off by ~4) and a "type" after
    "rope_type" overrode it; HF reads rope_scaling as rope_parameters and rope_type before type."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from minillama.rope import inv_frequencies

    d = {**ckpt_config(vocab=320).to_dict(), "rope_theta": 1e4, "rope_scaling": None, **rope}
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = hf_config(tmp_path / "config.json")
    hf = transformers.LlamaConfig.from_json_file(str(tmp_path / "config.json"))
    want = {k: v for k, v in hf.rope_parameters.items() if k not in ("rope_theta", "type")}
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.rope_scaling == (None if want["rope_type"] == "default" else want)
    assert torch.allclose(inv_frequencies(ours).float(), LlamaRotaryEmbedding(hf).inv_freq, rtol=1e-6, atol=0)


def _untied_dir(tmp_path: Path, same: bool) -> tuple[Path, dict]:
    from safetensors.torch import save_file

    config = ckpt_config(vocab=320, tied=False)
    sd = random_state_dict(config, seed=3)
    if same:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    d = save_hf_dir(config, sd, byte_bpe_tokenizer_hf(), tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, sd


def byte_bpe_tokenizer_hf() -> HFTokenizer:
    return HFTokenizer(byte_bpe_tokenizer(320), bos_token="<|im_start|>", eos_tokens=["<|im_end|>"])


def test_a_tied_config_with_a_different_stored_head_keeps_the_head_as_transformers_does(tmp_path, capsys):
    import transformers

    d, sd = _untied_dir(tmp_path, same=False)
    model, _ = load_model(d)
    err = capsys.readouterr().err
    assert "warning:" in err and "lm_head.weight differs" in err and len(err.strip().splitlines()) == 1
    ref = transformers.LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager")
    assert torch.equal(ref.lm_head.weight, sd["lm_head.weight"])  # what HF does: the stored head
    ids = list(range(3, 40))
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids])).logits[0]
        cache = model.new_cache()
        s = cache.new_segment()
        got = model(torch.tensor(ids), torch.arange(len(ids)), torch.full((len(ids),), s), cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # a tensor-parallel rank's load decides the tie alike (it read the two tensors onto the meta device: a
    # traceback, "Tensor.item() cannot be called on meta tensors")
    ranked, _ = load_model(d, shard=lambda skeleton: {})
    assert torch.equal(ranked.lm_head.weight, sd["lm_head.weight"])


def test_a_tied_config_with_a_stored_head_of_another_shape_is_one_line(tmp_path, capsys):
    """A head of another shape was warned about as a head that differs (a second line, misleading) before the
    shape error; with the tensor-parallel reader (hf_dir_config) the same."""
    from safetensors.torch import load_file, save_file

    from minillama.weights.hf import hf_dir_config

    d, sd = _untied_dir(tmp_path, same=False)
    stored = load_file(str(d / "model.safetensors"))
    save_file({**stored, "lm_head.weight": stored["lm_head.weight"][:-1].contiguous()}, str(d / "model.safetensors"))
    for load in (load_model, hf_dir_config):
        with pytest.raises(WeightsError, match=r"tensor lm_head.weight has shape \(319, 64\) but the config implies "
                                               r"\(320, 64\)"):
            load(d)
        assert capsys.readouterr().err == ""


def test_a_tied_config_with_an_equal_stored_head_stays_tied_quietly(tmp_path, capsys):
    d, _ = _untied_dir(tmp_path, same=True)
    model, _ = load_model(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert capsys.readouterr().err == ""


# --- silently wrong: the Python API checks what the command line checks ----------------------------------


@pytest.fixture(scope="module")
def model() -> api.LoadedModel:
    return tiny_loaded()


def test_one_stop_string_is_one_stop_string(model):
    tok = model.tokenizer
    text = "the bridge over the town"
    ids = tok.encode(text)
    params = api.sampling_params(stop="town", tokenizer=tok)  # read letter by letter, "t" would stop it
    assert [params.stop(ids[:n]) for n in range(1, len(ids) + 1)] == \
        ["town" in tok.decode(ids[:n]) for n in range(1, len(ids) + 1)]
    assert api.answer_text(tok, ids, set(), stop="town") == "the bridge over the "
    one = api.ask(model, DOC, QUESTIONS[:2], max_new_tokens=8, ignore_eos=True, stop="\x05\x05")
    listed = api.ask(model, DOC, QUESTIONS[:2], max_new_tokens=8, ignore_eos=True, stop=["\x05\x05"])
    assert one == listed


BAD_OPTIONS = [
    ({"parallel_size": -1}, ValueError, "parallel_size"), ({"parallel_size": 0}, ValueError, "parallel_size"),
    ({"batch_docs": -1}, ValueError, "batch_docs"), ({"batch_docs": 2.5}, TypeError, "batch_docs"),
    ({"max_new_tokens": -1}, ValueError, "max_new_tokens"), ({"max_new_tokens": 4.0}, TypeError, "max_new_tokens"),
    ({"temperature": float("nan")}, ValueError, "temperature"), ({"temperature": "0.5"}, TypeError, "temperature"),
    ({"temperature": float("inf")}, ValueError, "temperature"), ({"top_k": -3}, ValueError, "top_k"),
    ({"top_p": 0.0}, ValueError, "top_p"), ({"top_p": 1.5}, ValueError, "top_p"), ({"seed": 1.5}, TypeError, "seed"),
    ({"stop": [""]}, ValueError, "stop"), ({"stop": ""}, ValueError, "stop"), ({"stop": [3]}, TypeError, "stop"),
    ({"stop": "\ud800"}, ValueError, "surrogate"), ({"mode": "fast"}, ValueError, "mode"),
    ({"ignore_eos": "yes"}, TypeError, "ignore_eos"), ({"chat_template": None}, TypeError, "chat_template"),
    ({"system": b"be brief"}, TypeError, "system"), ({"prefill_chunk": 0}, ValueError, "prefill_chunk"),
    ({"keep_logits": 1}, TypeError, "keep_logits"), ({"on_token": 3}, TypeError, "on_token"),
    ({"temperature": 10**400}, ValueError, "temperature"), ({"top_k": 2**63}, ValueError, "top_k"),
    ({"seed": 2**64}, ValueError, "seed"), ({"stop": "Q" * 1025}, ValueError, "stop"),
    ({"bogus": 1}, TypeError, "ask() got an unexpected keyword argument 'bogus'"),  # once in ask_many's name
]


@pytest.mark.parametrize("bad,kind,word", BAD_OPTIONS, ids=[str(b) for b, _, _ in BAD_OPTIONS])
def test_every_bad_api_option_raises_naming_it(model, bad, kind, word):
    with pytest.raises(kind, match=re.escape(word)):
        api.ask(model, DOC, QUESTIONS[:1], **{"max_new_tokens": 2, **bad})


def test_generate_and_load_refuse_their_arguments_by_name(ckpt, model):
    """Token-id prompts, their documents and streams, and load's dtype, device and path: each bad one is
    refused naming it, not met inside torch (an index error, an overflow) or dropped (a prompt with no
    document once came back as an empty answer)."""
    import numpy as np

    from minillama.generate import SamplingParams, generate

    llama, vocab = model.llama, model.llama.config.vocab_size
    params = SamplingParams(max_new_tokens=2)
    bad = [("prompt 0: token ids must be in", [[5, -1]], None, None),
           ("prompt 1: token ids must be in", [[5], [vocab]], None, None),
           ("prompt 0 must be a list of integer token ids", [[5, 2.5]], None, None),
           ("prompts must be a list", "abc", None, None),
           ("docs must name one for each of the 2 prompts", [[5], [6]], [0], None),
           ("streams must name one for each", [[5], [6]], None, [0]),
           ("streams must be integers", [[5]], None, [-1])]
    for words, prompts, docs, streams in bad:
        with pytest.raises((ValueError, TypeError), match=re.escape(words)):
            generate(llama, prompts, params, docs=docs, streams=streams)
    with pytest.raises(TypeError, match="model must be a Llama"):
        generate(model, [[5]], params)
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        generate(llama, [[5]], {"max_new_tokens": 2})
    # numpy and torch integers are integers: the same answers as Python's
    sampled = SamplingParams(max_new_tokens=3, temperature=0.8, seed=7)
    same = generate(llama, [[5, 6, 7]], sampled, parallel_size=1)[0].token_ids
    assert generate(llama, [np.array([5, 6, 7])], SamplingParams(max_new_tokens=3, temperature=0.8, seed=np.int64(7)),
                    parallel_size=np.int64(1))[0].token_ids == same
    assert generate(llama, [torch.tensor([5, 6, 7])], sampled, streams=np.array([0]))[0].token_ids == same
    # and stop at the token they hold (a 0-d tensor hashes by identity: it never stopped; an array raised)
    free = generate(llama, [[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    for as_int in (np.int64, np.array, torch.tensor):
        ended = generate(llama, [[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True,
                                                            stop_token_ids=[as_int(free[1])]))[0]
        assert ended.token_ids == free[:free.index(free[1]) + 1] and ended.finish_reason == "stop", as_int
        assert generate(llama, [[5, 6, 7]], SamplingParams(max_new_tokens=6), eos_ids=[as_int(free[1])]
                        )[0].token_ids == ended.token_ids, as_int
    for kwargs, words in (({"dtype": "bf16"}, "dtype must be one of float32, bfloat16, float16"),
                          ({"dtype": torch.int8}, "dtype must be one of"), ({"device": "gpu"}, "device gpu: not a torch device"),
                          ({"device": "meta"}, "device meta: holds shapes, not numbers"), ({"device": None}, "device must be a str")):
        with pytest.raises((ValueError, TypeError), match=re.escape(words)):
            api.load(ckpt, **kwargs)
    with pytest.raises(TypeError, match="path must be a str or a Path"):
        api.load(str(ckpt).encode())
    with pytest.raises(WeightsError, match="an empty path: give a checkpoint"):  # not the working directory
        api.load("")
    assert api.load(ckpt, dtype="bfloat16").llama.dtype == torch.bfloat16
    for not_a_model in ("path/to/model", None, model.llama, (model.llama, None)):  # once "too many values to unpack"
        with pytest.raises(TypeError, match="model must be what minillama.load returns"):
            api.ask(not_a_model, DOC, QUESTIONS[:1], max_new_tokens=1)
    assert api.ask((model.llama, model.tokenizer), DOC, QUESTIONS[:1], max_new_tokens=1)  # a pair unpacks alike
    with pytest.raises(ValueError, match="first_question must hold one integer >= 0 for each of the 1 documents"):
        api.ask_many(model, [(DOC, QUESTIONS[:1])], max_new_tokens=1, first_question=[0.9])
    # once accepted without a word (a stop id past the vocabulary, an EOS id as text) or an error of the reading
    with pytest.raises(ValueError, match=r"stop_token_ids must be in 0 \.\. 299 \(the model's vocabulary\)"):
        api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=1, stop_token_ids=[10**9])
    with pytest.raises(TypeError, match="eos_ids must be a list of integer token ids, got '2'"):
        generate(model.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=1), eos_ids="2")
    with pytest.raises(ValueError, match=r"^eos_ids must be token ids >= 0, got \[2, -5\]$"):
        generate(model.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=1), eos_ids=[2, -5])  # once taken silently
    assert generate(model.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=1), eos_ids=[2, 10**9])  # never comes
    with pytest.raises(TypeError, match="docs must name each prompt's document"):
        generate(model.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=1), docs=[[0]])


def test_narrow_and_zero_d_integers_are_the_integers_they_hold(model):
    """numpy's int8 and uint8 wrap at 127 and 255: used as they came, parallel_size=np.int8(100) answered 100 of
    130 questions and gave the rest empty replies, first_question=[np.uint8(255)] gave a question another's
    random stream, max_new_tokens=np.int8(5) raised an OverflowError. A 0-d torch integer was refused as no
    integer. Each is now its Python int: the same replies, to the bit."""
    import numpy as np

    questions = [f"{q} ({k})" for k in range(33) for q in QUESTIONS][:130]
    base = api.ask(model, DOC, questions, max_new_tokens=1, ignore_eos=True)
    assert all(r.token_ids for r in base)
    for narrow in (np.int8(100), torch.tensor(100, dtype=torch.uint8), torch.tensor(100)):
        assert api.ask(model, DOC, questions, max_new_tokens=1, ignore_eos=True, parallel_size=narrow) == base
    jobs = [(DOC, QUESTIONS[:2])] * 130
    many = api.ask_many(model, jobs, max_new_tokens=1, ignore_eos=True)
    assert api.ask_many(model, jobs, max_new_tokens=1, ignore_eos=True, batch_docs=np.int8(100)) == many
    sampled = {"max_new_tokens": np.int8(4), "temperature": 1.0, "ignore_eos": True, "seed": torch.tensor(3)}
    want = api.ask_many(model, [(DOC, QUESTIONS[:3])], first_question=[255], **{**sampled, "max_new_tokens": 4,
                                                                                  "seed": 3})
    for k in (np.uint8(255), torch.tensor(255)):
        assert api.ask_many(model, [(DOC, QUESTIONS[:3])], first_question=[k], **sampled) == want
    assert api.ask(model, DOC, QUESTIONS[:1], mode="independent", max_new_tokens=2, prefill_chunk=np.int8(100)) == \
        api.ask(model, DOC, QUESTIONS[:1], mode="independent", max_new_tokens=2)
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=torch.tensor([2]))  # a 1-element vector is no integer


def test_sampling_params_changed_after_they_were_made_are_checked_again(model):
    """SamplingParams was checked when made only: p.temperature = nan set after gave greedy-looking zeros,
    p.max_new_tokens = "3" a TypeError from inside the loop. Stop strings with no tokenizer failed after the
    prefill."""
    from minillama.generate import SamplingParams, generate

    for field, value, kind in (("temperature", float("nan"), ValueError), ("top_p", 0.0, ValueError),
                               ("max_new_tokens", -1, ValueError), ("max_new_tokens", "3", TypeError)):
        p = SamplingParams(max_new_tokens=3)
        setattr(p, field, value)
        with pytest.raises(kind, match=field):
            generate(model.llama, [[5, 6, 7]], p)
    with pytest.raises(ValueError, match="stop strings need the tokenizer"):
        generate(model.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=3, stop="x"), on_token=pytest.fail)


def test_forward_takes_any_integer_tensor_and_refuses_before_the_cache_changes(model):
    """uint8 ids, int16 positions and 2-D logits rows failed inside the pass (an embedding's or an index's
    error) after the cache had given the tokens slots: a retry at the same positions was refused."""
    llama = model.llama
    cache = llama.new_cache()
    seg = cache.new_segment()
    want = llama(torch.tensor([5, 6]))  # one fresh sequence at positions 0, 1
    with pytest.raises(ValueError, match="logits_rows must be 1-D"):
        llama(torch.tensor([5, 6]), torch.tensor([0, 1]), torch.tensor([seg, seg]), cache, torch.tensor([[0, 1]]))
    got = llama(torch.tensor([5, 6], dtype=torch.uint8), torch.tensor([0, 1], dtype=torch.int16),
                torch.tensor([seg, seg], dtype=torch.int8), cache)
    assert torch.equal(got, want) and cache.length(seg) == 2
    import numpy as np

    units = llama.units
    llama.units = np.int64(1)  # once "units must divide the model's 2 KV heads, got 1"
    assert llama.units == 1 and type(llama.units) is int
    with pytest.raises(ValueError, match="units must be an integer"):
        llama.units = True
    llama.units = units


def test_prompt_ids_checks_its_text_and_takes_a_loaded_model(model):
    """minillama.prompt_ids(tok, None, "q") raised "'NoneType' object has no attribute 'strip'"."""
    assert api.prompt_ids(model, DOC, "Why?") == api.prompt_ids(model.tokenizer, DOC, "Why?")
    for doc, question, words in ((None, "q", "document 1 must be a string"), ("d", 5, "question 1 must be a string"),
                                 ("d", " ", "question 1 is empty")):
        with pytest.raises(ValueError, match=words):
            api.prompt_ids(model.tokenizer, doc, question)
    with pytest.raises(TypeError, match="system"):
        api.prompt_ids(model.tokenizer, DOC, "q", system=b"x")


def test_a_model_on_the_meta_device_is_refused_in_one_line():
    """load(device="meta") is refused; a loaded model moved there (`llama.to("meta")`), or one that holds a meta
    weight, met a RuntimeError deep in the first pass."""
    from minillama.generate import SamplingParams, generate

    moved = tiny_loaded()
    moved.llama.to("meta")
    with pytest.raises(ValueError, match=r"^model device meta: holds shapes, not numbers; choose cpu or an acc"):
        api.ask(moved, DOC, QUESTIONS[:1], max_new_tokens=2)
    part = tiny_loaded()
    part.llama.model.norm.to("meta")
    with pytest.raises(ValueError, match=r"^model device meta: holds shapes"):
        generate(part.llama, [[5, 6, 7]], SamplingParams(max_new_tokens=2))


def test_prompt_ids_takes_what_ask_takes_and_refuses_the_rest(model):
    """prompt_ids((llama, tok), ...), as ask takes it, and prompt_ids(llama or None, ...) raised AttributeError
    ("'tuple' object has no attribute 'chat_template'") from deep inside."""
    want = api.prompt_ids(model.tokenizer, DOC, "Why?")
    assert api.prompt_ids((model.llama, model.tokenizer), DOC, "Why?") == want
    for bad in (model.llama, None, (model.llama, None), "tok"):
        with pytest.raises(TypeError, match=r"^tokenizer must be a Tokenizer, what minillama.load returns or a "
                                            rf"\(Llama, tokenizer\) pair, got {type(bad).__name__}$"):
            api.prompt_ids(bad, DOC, "Why?")


BAD_JOBS = [
    ([(b"bytes doc", ["q"])], TypeError, "bytes; decode"), ([("", ["q"])], ValueError, "document 1 is empty"),
    ([("  \n", ["q"])], ValueError, "empty"), ([(DOC, [])], ValueError, "no questions"),
    ([(DOC, "one string")], TypeError, "list of strings"), ([(DOC, ["q", b"x"])], TypeError, "question 2"),
    ([(DOC, ["q", " "])], ValueError, "question 2 is empty"), ([(DOC, ["\udcff"])], ValueError, "surrogate"),
    ([("\ud83d half", ["q"])], ValueError, "surrogate"), ([(DOC,)], TypeError, "pair"), ("text", TypeError, "jobs"),
]


@pytest.mark.parametrize("jobs,kind,word", BAD_JOBS, ids=[repr(j)[:30] for j, _, _ in BAD_JOBS])
def test_bad_documents_and_questions_raise_naming_them(model, jobs, kind, word):
    with pytest.raises(kind, match=re.escape(word)):
        api.ask_many(model, jobs, max_new_tokens=2)


def test_the_cli_and_the_api_refuse_with_the_same_check(ckpt, inputs, model, capsys):
    for api_opt, cli_opt in [({"parallel_size": 0}, ["--parallel-size", "0"]), ({"top_p": 1.5}, ["--top-p", "1.5"]),
                             ({"batch_docs": -1}, ["--batch-docs", "-1"])]:
        with pytest.raises(ValueError) as e:
            api.ask(model, DOC, QUESTIONS[:1], **api_opt)
        code = cli.main([str(a) for a in ["--model", ckpt, "--doc", inputs["doc"], "--questions",
                                          inputs["questions"], *cli_opt]])
        line = one_line_error((code, capsys.readouterr().err))
        name = next(iter(api_opt))
        assert line == "error: " + checks.flag(name) + str(e.value).removeprefix(name)  # the table spells it


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_token(model, temperature):
    greedy = api.ask(model, DOC, QUESTIONS[:2], max_new_tokens=6)
    tiny = api.ask(model, DOC, QUESTIONS[:2], max_new_tokens=6, temperature=temperature, top_k=5, top_p=0.9)
    assert [r.token_ids for r in tiny] == [r.token_ids for r in greedy]


# --- the cost of saying no ---------------------------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and counts the characters it is asked to tokenize."""

    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, *a, **k):
        self.chars += len(text)
        return self.tok.encode(text, *a, **k)

    def encode_chat(self, messages, *a, **k):
        self.chars += sum(len(m["content"]) for m in messages)
        return self.tok.encode_chat(messages, *a, **k)


@pytest.mark.parametrize("size", [5_000_000, 3_000])
def test_refusing_a_long_document_costs_at_most_one_pass(size):
    small = tiny_loaded(max_pos=256)
    counting = CountingTokenizer(small.tokenizer)
    checks.dropped(counting)  # the tokenizer's one probe of which characters it keeps (short strings), cached
    counting.chars = 0
    doc = ("The bridge was built in 1932. " * (size // 30 + 1))[:size]
    with pytest.raises(api.PromptTooLong, match="context is 256"):
        api.ask(api.LoadedModel(small.llama, counting), doc, QUESTIONS * 3, max_new_tokens=2)
    if size > 1_000_000:
        assert counting.chars == 0  # refused from the length of the text alone
    else:  # near the context, the one tokenized prompt decides: not every question's prompt
        assert len(doc) <= counting.chars <= len(doc) + 200


def test_the_cli_refuses_a_huge_document_before_tokenizing_it(ckpt, inputs, capsys, monkeypatch):
    big = inputs["dir"] / "big.txt"
    big.write_text("word " * 2_000_000)
    seen = []
    monkeypatch.setattr(HFTokenizer, "encode", lambda self, text, *a, **k: seen.append(len(text)) or [0])
    code = cli.main([str(a) for a in ["--model", ckpt, "--doc", big, "--questions", inputs["questions"]]])
    assert "context is 512" in one_line_error((code, capsys.readouterr().err))
    assert sum(seen) < 1000  # the template's few words, never the document


# --- malformed configs: every field's type and range, named, before anything is allocated -----------------

BAD_CONFIGS = {
    "a list": ([1, 2], "JSON object"),
    "string eps": ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    "zero eps": ({"rms_norm_eps": 0}, "rms_norm_eps"),
    "nan theta": ({"rope_theta": float("nan")}, "rope_theta"),
    "huge context": ({"max_position_embeddings": 10**12}, "max_position_embeddings"),
    "negative vocab": ({"vocab_size": -5}, "vocab_size"),
    "float hidden": ({"hidden_size": 64.5}, "hidden_size"),
    "absurd layers": ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    "bool heads": ({"num_attention_heads": True}, "num_attention_heads"),
    "string tie": ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    "rope_scaling a list": ({"rope_scaling": [8.0]}, "rope_scaling"),
    "llama3 missing keys": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    "llama3 bad band": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                          "high_freq_factor": 1.0, "original_max_position_embeddings": 64}},
                        "high_freq_factor"),
    "string eos": ({"eos_token_id": "</s>"}, "eos_token_id"),
    "deeply nested": (None, "not readable JSON"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_every_bad_config_value_is_one_line_naming_the_field(ckpt, tmp_path, case):
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    change, word = BAD_CONFIGS[case]
    if change is None:
        (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    else:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(change if isinstance(change, list) else {**cfg, **change}))
    with pytest.raises(WeightsError, match=re.escape(word)):
        load_model(d)
    assert word in one_line_error(run_tool("weights", "info", d))


def test_integer_weights_are_refused(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(d / "model.safetensors"))
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int32)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match="model.norm.weight holds int32; weights must be floating point"):
        load_model(d)


def test_a_gguf_with_a_huge_context_is_refused_naming_the_field(tmp_path):
    from _ckpt_writers import gguf_tokenizer_metadata, write_gguf

    config = ckpt_config(vocab=320)
    sd = random_state_dict(config)
    config.max_position_embeddings = 2**31  # past the check: what a broken or hostile file can say
    path = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(byte_bpe_tokenizer(320)))
    with pytest.raises(WeightsError, match="max_position_embeddings must be in 1 .. 4194304"):
        load_model(path)


def test_gguf_metadata_of_the_wrong_type_is_one_line():
    from types import SimpleNamespace

    from minillama.weights import gguf as weights

    meta = {"general.architecture": "llama", "llama.embedding_length": "64", "llama.attention.head_count": 4,
            "llama.block_count": 2}
    with pytest.raises(WeightsError, match="x.gguf: llama metadata of the wrong type or value"):
        weights._checked_gguf_config(meta, set(), "x.gguf", SimpleNamespace(tensors=[]))


@pytest.mark.parametrize("missing", ["llama.context_length", "llama.block_count", "llama.embedding_length"])
def test_gguf_metadata_without_a_required_key_is_one_line(missing):
    """A context length left out is not taken as some default (llama.cpp refuses such a file too)."""
    from types import SimpleNamespace

    from minillama.weights import gguf as weights

    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "llama.block_count": 2, "llama.context_length": 512}
    del meta[missing]
    with pytest.raises(WeightsError, match=r"^x\.gguf: incomplete llama metadata \(embedding_length, "
                                           r"attention\.head_count, block_count and context_length are required"):
        weights._checked_gguf_config(meta, set(), "x.gguf", SimpleNamespace(tensors=[]))


@pytest.mark.parametrize("option", [["--stop", "\udcff"], ["--system", "be \udce9brief"]])
def test_arguments_that_are_not_utf8_are_one_line(ckpt, inputs, capsys, option):
    # Python hands undecodable argv bytes over as lone surrogates: named as the bytes the user typed.
    code = cli.main([str(a) for a in ["--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"],
                                      *option]])
    byte = f"{ord(option[1][-1] if option[0] == '--stop' else option[1][3]) - 0xDC00:02X}"
    assert f"{option[0]}: the byte 0x{byte} at character" in one_line_error((code, capsys.readouterr().err))


@pytest.mark.parametrize("bad", [{"parallel_size": -1}, {"batch_docs": 0}, {"prefill_chunk": -5},
                                 {"parallel_size": 1.5}])
def test_generate_on_token_ids_refuses_sizes_that_would_answer_nothing(model, bad):
    from minillama.generate import generate

    with pytest.raises(ValueError, match=next(iter(bad))):
        generate(model.llama, [[5, 6, 7], [5, 6, 8]], **bad)


# --- top_p so small that float32 rounds it to 0: the likeliest token, everywhere alike ------------------------

TINY_TOP_P = [1e-300, 1e-46, 5e-324]


@pytest.mark.parametrize("top_p", TINY_TOP_P)
def test_a_top_p_that_float32_rounds_to_0_keeps_the_likeliest_token(ckpt, inputs, model, capsys, top_p):
    """The API and the command line answer it with the greedy tokens (only the likeliest token is left);
    before, the row of logits became all -inf and sampling failed on NaN (a traceback)."""
    greedy = api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=3)
    tiny = api.ask(model, DOC, QUESTIONS[:1], max_new_tokens=3, temperature=1.0, top_p=top_p)
    assert [r.token_ids for r in tiny] == [r.token_ids for r in greedy]
    code = cli.main([str(a) for a in ["--model", ckpt, "--doc", inputs["doc"], "--questions", inputs["questions"],
                                      "--temperature", "1", "--top-p", repr(top_p), "-n", "3"]])
    assert code == 0, capsys.readouterr().err


def test_a_top_p_or_temperature_that_is_0_as_a_float_is_refused():
    """A Fraction or long double above 0 that a float rounds to 0 once passed the check and then sampled
    token 0 every time (the check ran on the value, the sampler on its float); a temperature so was greedy."""
    from fractions import Fraction

    import numpy as np

    from minillama.generate import SamplingParams

    for top_p in (Fraction(1, 10**400), np.longdouble("1e-400")):
        with pytest.raises(ValueError, match="top_p must be above 0 as a float"):
            SamplingParams(temperature=1.0, top_p=top_p)
    assert SamplingParams(top_p=Fraction(1, 2)).top_p == 0.5
    for temperature in (Fraction(1, 10**400), np.longdouble("1e-400")):
        with pytest.raises(ValueError, match="temperature must be 0 or above 0 as a float"):
            SamplingParams(temperature=temperature)
    assert SamplingParams(temperature=np.longdouble(0)).temperature == 0 and SamplingParams(temperature=5e-324)


def test_every_accepted_top_p_samples_a_token():
    """The least top_p accepted (the smallest float64 above 0) and others, at every temperature, on rows with
    -inf entries and ties: a token always comes out (the likeliest survives the cut), never a NaN."""
    from minillama.generate import SamplingParams, sample

    for step, top_p in enumerate((5e-324, 1e-300, 2.0**-149, 1e-45, 1e-30, 1e-7, 0.5, 1.0)):
        for temperature in (5e-324, 1e-30, 1.0, 1e30):
            for row in (torch.randn(64), torch.zeros(64), torch.tensor([0.0, float("-inf")] * 32)):
                params = SamplingParams(temperature=temperature, top_p=top_p, top_k=3)
                tok = sample(row, params, 0, step)
                assert 0 <= tok < 64 and row[tok] > float("-inf")


# --- chat templates and tokenizer files are the user's files: one line naming the file and the field --------

MISTRAL_V01 = (  # Mistral-7B-Instruct-v0.1's template: a system turn is refused by the template itself
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")


def _added_token(t: dict, i: int) -> None:
    t["added_tokens"].append({"id": i, "content": "<past>", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True})


# case -> (file, change, words the line must hold); the template cases render with --system
TOKENIZER_FILES = {
    "mistral system": ("tokenizer_config.json", {"chat_template": MISTRAL_V01},
                       ["tokenizer_config.json, field chat_template", "Conversation roles must alternate"]),
    "syntax error": ("tokenizer_config.json", {"chat_template": "{% for m in messages %}{{ m.content }"},
                     ["tokenizer_config.json, field chat_template", "not a valid Jinja template (line 1"]),
    "nested range": ("tokenizer_config.json",
                     {"chat_template": "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}"
                                       "{% endfor %}"},
                     ["tokenizer_config.json, field chat_template", "more than 100,000 items"]),
    "enormous range": ("tokenizer_config.json", {"chat_template": "{% for i in range(10**12) %}x{% endfor %}"},
                       ["field chat_template", "range"]),
    "repetition": ("tokenizer_config.json", {"chat_template": "{{ 'x' * 10**10 }}"},
                   ["field chat_template", "repetition past the sandbox's bound"]),
    "recursion": ("tokenizer_config.json", {"chat_template": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"},
                  ["field chat_template", "the template failed"]),
    "eos_token 5": ("tokenizer_config.json", {"eos_token": 5}, ['tokenizer_config.json: "eos_token" must be']),
    "add_bos_token text": ("tokenizer_config.json", {"add_bos_token": "yes"},
                           ['tokenizer_config.json: "add_bos_token" must be']),
    "eos_token_ids text": ("tokenizer_config.json", {"eos_token_ids": ["</s>"]},
                           ['tokenizer_config.json: "eos_token_ids" must be']),
    "chat_template number": ("tokenizer_config.json", {"chat_template": 7},
                             ['tokenizer_config.json: "chat_template" must be']),
    "eos_token_id text": ("generation_config.json", {"eos_token_id": "</s>"},
                          ['generation_config.json: "eos_token_id" must be']),
    "template without the content": ("tokenizer_config.json", {"chat_template": "{{ 'hello' }}"},
                                     ["field chat_template", "does not write each message's content"]),
    "template that cuts the content": ("tokenizer_config.json",
                                       {"chat_template": "{% for m in messages %}{{ m['content'][:5] }}{% endfor %}"},
                                       ["field chat_template", "does not write each message's content"]),
    "template that skips the system turn": (
        "tokenizer_config.json",
        {"chat_template": "{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}\n"
                          "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"},
        ["field chat_template", "does not write the system prompt (it would be lost)"]),
    "templates without a default": ("tokenizer_config.json", {"chat_template": [{"name": "tool_use", "template": "x"}]},
                                    ['field chat_template: a list of templates, none named "default"']),
    "bos not a token": ("tokenizer_config.json", {"bos_token": "<|nope|>", "add_bos_token": True},
                        ['"bos_token" \'<|nope|>\' is not a token', "no BOS could be added"]),
    "id past the vocabulary": ("tokenizer.json", lambda t: _added_token(t, 300),
                               ["tokenizer.json, added_tokens: token id 300 ('<past>') is past the model's vocabulary"]),
}


def test_end_of_sequence_ids_the_model_could_never_write_are_refused():
    """Where every end-of-sequence id is past the model's vocabulary no answer could end: refused when the
    model loads (`check_fits`); one past it beside one inside changes nothing (the inside one ends answers)."""
    from minillama.tokenizer import TokenizerError
    from test_api import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.eos_ids = [2, 999999]
    tok.check_fits(tok.vocab_size)
    tok.eos_ids = [999999]
    with pytest.raises(TokenizerError, match=r"every end-of-sequence id \(999999\) is past the model's vocab"):
        tok.check_fits(tok.vocab_size)


def _changed_checkpoint(ckpt: Path, tmp_path: Path, case: str) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    name, change, _ = TOKENIZER_FILES[case]
    data = json.loads((d / name).read_text()) if (d / name).exists() else {}
    change(data) if callable(change) else data.update(change)
    (d / name).write_text(json.dumps(data))
    return d


@pytest.mark.parametrize("case", list(TOKENIZER_FILES))
def test_a_wrong_tokenizer_file_is_one_line_naming_the_file_and_field(ckpt, inputs, tmp_path, capsys, case):
    """The command line: one line naming the file and the field, exit 2, nothing answered; the API: the same
    words, from `api.load` (a WeightsError: the checkpoint's tokenizer) or from the first prompt (a
    TokenizerError), both one-line errors."""
    from minillama.errors import OneLineError

    d = _changed_checkpoint(ckpt, tmp_path, case)
    *_, words = TOKENIZER_FILES[case]
    code = cli.main([str(a) for a in ["--model", d, "--doc", inputs["doc"], "--questions", inputs["questions"],
                                      "--system", "Be brief.", "-n", "2"]])
    out, err = capsys.readouterr()
    line = one_line_error((code, err))
    assert out == "" and all(w in line for w in words), line
    with pytest.raises(OneLineError) as e:
        api.ask(api.load(d), DOC, QUESTIONS[:1], system="Be brief.", max_new_tokens=2)
    assert all(w in str(e.value) for w in words), e.value


def test_an_empty_model_path_is_refused_not_read_as_the_working_directory(inputs, capsys):
    """`--model ""` (an unset shell variable) once searched the working directory for a checkpoint and said
    `--model (default): .: neither an HF directory...`: it names the empty path now."""
    code = cli.main(["--model", "", "--doc", str(inputs["doc"]), "--questions", str(inputs["questions"])])
    out, err = capsys.readouterr()
    assert out == "" and one_line_error((code, err)) == (
        "error: --model '': an empty path: give a checkpoint (an HF or Meta directory or a .gguf file), "
        "or none for the default model")
