"""GGUF files against llama.cpp itself (llama-cpp-python, in process): tokenizers read from `tokenizer.ggml.*`
(each gpt2 pre-tokenizer minillama supports, and a sentencepiece `llama` vocabulary) encode and decode as llama.cpp
does, BOS added as llama.cpp adds it, and a tiny random model's logits from its metadata (RoPE scalings, tied
head, F16) as llama.cpp computes them. Tiny files written here; llama.cpp loads them in milliseconds.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from _ckpt_writers import (byte_bpe_tokenizer, gguf_tokenizer_metadata, random_state_dict, sentencepiece_model,
                           sp_gguf_tokenizer_metadata, tiny_config, write_gguf)
from minillama.tokenizer import load_tokenizer
from minillama.tokenizer.bpe import BPE_PRE_TOKENIZERS
from minillama.weights import load_model
from minillama.weights.gguf import llama3_rope_factors

try:
    import llama_cpp
except ImportError:  # CI installs it (.ci/run) and sets MINILLAMA_REQUIRE_LLAMA_CPP: there a missing one fails
    if os.environ.get("MINILLAMA_REQUIRE_LLAMA_CPP"):
        raise
    pytest.skip("llama_cpp is not installed (pip install 'llama-cpp-python[server]==0.3.36')", allow_module_level=True)

# No space before ?!., or an apostrophe here: llama.cpp's decoding takes those out after some pre-tokenizers (gpt-2,
# llama3, starcoder: HF's clean_up_tokenization_spaces), minillama's never does.
TEXTS = ["Hello world", "  two  spaces   and three ", "\n\n\nnewlines\n \n", "digits 1234567 3.14159", "\ttab\t",
         "naïve café Straße 日本語", "emoji 🙂🚀 x²", "<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b",
         "", " leading", "<s> and </s> and <unk>", "<sep> sep"]


def llama_cpp_vocab(path) -> "llama_cpp.Llama":
    return llama_cpp.Llama(str(path), vocab_only=True, verbose=False)


def llama_cpp_decode(llm, ids: list[int], specials: bool) -> str:
    """llama.cpp's detokenizer (`llama_detokenize`): control tokens written out or left out, nothing else removed."""
    buf = ctypes.create_string_buffer(1 << 14)
    n = llama_cpp.llama_detokenize(llm._model.vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buf,
                                   len(buf), False, specials)
    assert n >= 0
    return buf.raw[:n].decode()


def gguf_file(tmp_path, pre: str | None, **tok: object):
    """A tiny model's GGUF with a gpt2 vocabulary split by `pre`, or (None) a sentencepiece `llama` one."""
    meta = gguf_tokenizer_metadata(byte_bpe_tokenizer()) if pre else sp_gguf_tokenizer_metadata(sentencepiece_model())
    config = tiny_config(vocab=len(meta["tokens"]))
    return write_gguf(tmp_path / f"{pre or 'llama'}.gguf", config, random_state_dict(config),
                      {**meta, **({"pre": pre} if pre else {}), **tok})


@pytest.mark.parametrize("pre", [*BPE_PRE_TOKENIZERS, None])
def test_gguf_tokenizers_encode_and_decode_as_llama_cpp(tmp_path, pre):
    path = gguf_file(tmp_path, pre)
    ours, llm = load_tokenizer(path), llama_cpp_vocab(path)
    control = {ours.token_to_id(t) for t in ours.special_tokens()}
    for text in TEXTS:
        for special in (False, True):
            for add in (False, True):
                ids = llm.tokenize(text.encode(), add_bos=add, special=special)
                assert ours.encode(text, add_special=add, parse_special=special) == ids, (text, special, add)
                # Not a sentencepiece text after a control token: minillama decodes it as sentencepiece does, with
                # no space for its "▁", where llama.cpp writes the space
                if pre or not control & set(ids):
                    for skip in (False, True):
                        assert ours.decode(ids, skip_special=skip) == llama_cpp_decode(llm, ids, not skip), ids


@pytest.mark.parametrize("pre", [*BPE_PRE_TOKENIZERS, None])
def test_a_gguf_without_add_bos_token_adds_bos_as_llama_cpp_does(tmp_path, pre):
    """No `tokenizer.ggml.add_bos_token` (older files): llama.cpp's default, which is to add BOS for a
    sentencepiece vocabulary and Llama 3's pre-tokenizers (llama-bpe, llama3), and not for the others."""
    path = gguf_file(tmp_path, pre, add_bos=None)
    want = llama_cpp_vocab(path).tokenize(b"hi there", add_bos=True, special=True)
    assert load_tokenizer(path).encode("hi there", add_special=True) == want



def test_a_sentencepiece_gguf_without_eos_token_id_ends_as_llama_cpp_ends(tmp_path):
    """No `tokenizer.ggml.eos_token_id` in a `llama` vocabulary: llama.cpp's EOS is sentencepiece's own, id 2,
    and generation stops there."""
    path = gguf_file(tmp_path, None, eos=None)
    llm = llama_cpp_vocab(path)
    eog = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i)]
    assert load_tokenizer(path).eos_ids == eog == [llm.token_eos()]


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
MODELS = {  # name: (config changes, architecture, weights' type, max |dlogit|)
    "f32": ({}, "llama", Q.F32, 1e-4), "f16": ({}, "llama", Q.F16, 2e-2),
    "theta-eps": ({"rope_theta": 500000.0, "rms_norm_eps": 1e-2}, "llama", Q.F32, 1e-4),
    "tied-mqa": ({"tied": True, "kv_heads": 1}, "llama", Q.F32, 1e-4),
    "head-dim": ({"head_dim": 32}, "llama", Q.F32, 1e-4),
    "linear": ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "llama", Q.F32, 1e-4),
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
             "llama", Q.F32, 1e-4),
    "llama3": ({"rope_scaling": LLAMA3, "rope_theta": 500000.0, "hidden": 128, "heads": 2, "kv_heads": 1},
               "llama", Q.F32, 1e-4),
    "qwen2": ({"model_type": "qwen2"}, "qwen2", Q.F32, 1e-4), "qwen3": ({"model_type": "qwen3"}, "qwen3", Q.F32, 1e-4),
}


@pytest.mark.parametrize("name", MODELS)
def test_a_tiny_gguf_gives_llama_cpp_logits(tmp_path, name):
    """The model read from the file's metadata (RoPE base, scaling and llama3 `rope_freqs`, RMSNorm epsilon, head
    counts, head size, a head tied to the embedding) computes llama.cpp's logits, to float32 rounding (F16 weights:
    llama.cpp's F16 products), at 60 positions, past yarn's original context."""
    from minillama.oracle.backends import LlamaCppBackend

    changes, arch, qtype, tol = MODELS[name]
    config = tiny_config(**changes)
    freqs = llama3_rope_factors(LLAMA3, config.head_dim, config.rope_theta) if name == "llama3" else None
    path = write_gguf(tmp_path / f"{name}.gguf", config, random_state_dict(config), gguf_tokenizer_metadata(
        byte_bpe_tokenizer()), qtype=qtype, arch=arch, rope_freqs=freqs)
    model, _ = load_model(path)
    ids = np.random.default_rng(1).integers(3, config.vocab_size, 60).tolist()
    want = LlamaCppBackend(path, n_ctx=64, kv_type="f32").logits(ids)
    assert (model(torch.tensor(ids)) - want).abs().max().item() <= tol
