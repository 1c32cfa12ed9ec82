"""Tiny checkpoints for the weights and tokenizer tests, written in every format minillama reads.

A checkpoint starts as a random HF-layout state dict; the writers put it into each format the way that
format's own tools lay it out (Meta and GGUF: Q/K rows in interleaved RoPE order, Meta shards split
along fairscale's model-parallel dimensions, GGUF dimensions fastest-first and quantized by
`gguf.quants.quantize`). Tokenizers are trained here too: a sentencepiece BPE model and a byte-level BPE.
"""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillama.config import LlamaConfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 in the byte-level BPE
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tiny_config(vocab: int = 320, hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2,
                ffn: int = 192, tied: bool = False, **kw: Any) -> LlamaConfig:
    # ffn 192 is what Meta's sizing rule gives for dim 64 with multiple_of 32 (see meta_params).
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                       max_position_embeddings=256, rope_theta=kw.pop("rope_theta", 10000.0),
                       bos_token_id=1, eos_token_id=2, **kw)


def random_state_dict(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF names and layout; scaled so that logits spread out and Q/K mistakes show."""
    from minillama.weights import expected_shapes

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            sd[name] = 1 + 0.2 * torch.randn(shape, generator=g)
        elif "embed_tokens" in name:  # std 0.2: as a tied LM head it gives logits of a few units
            sd[name] = 0.2 * torch.randn(shape, generator=g)
        else:
            sd[name] = torch.randn(shape, generator=g) / shape[1] ** 0.5
    return sd


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `weights.interleaved_to_half`: rotate-half rows (or a bias) back to Meta/GGUF order."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(n_heads, 2, rows // n_heads // 2, *rest).transpose(1, 2).reshape(w.shape)


def _source_layout(config: LlamaConfig, sd: dict[str, torch.Tensor], table: dict[str, str | None],
                   interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF state dict -> source names (inverse of a weights.py name map), Q/K rows (and biases) interleaved
    unless `interleave` is False (llama.cpp's qwen2 and qwen3 keep rotate-half order)."""
    inverse = {v: k for k, v in table.items() if v is not None}
    out = {}
    for name, t in sd.items():
        m = re.search(r"\.(\d+)\.", name)
        key = name.replace(m.group(0), ".{i}.", 1) if m else name
        src = inverse[key].format(i=m.group(1)) if m else inverse[key]
        if interleave and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = half_to_interleaved(t, config.num_attention_heads)
        elif interleave and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = half_to_interleaved(t, config.num_key_value_heads)
        out[src] = t
    return out


# --------------------------------------------------------------------------------------------------
# HF directories


def write_hf_dir(out: Path, config: LlamaConfig, sd: dict[str, torch.Tensor], tokenizer: Any,
                 shards: int = 1) -> Path:
    from safetensors.torch import save_file

    from minillama.weights import save_hf_dir

    save_hf_dir(config, sd, tokenizer, out)
    if shards > 1:  # split model.safetensors into shards + index, as HF's save_pretrained does
        from safetensors.torch import load_file

        full = load_file(str(out / "model.safetensors"))
        (out / "model.safetensors").unlink()
        names = sorted(full)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: full[n] for n in names[k::shards]}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


# --------------------------------------------------------------------------------------------------
# Meta directories


def meta_params(config: LlamaConfig) -> dict[str, Any]:
    return {"dim": config.hidden_size, "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
            "n_kv_heads": config.num_key_value_heads, "vocab_size": -1, "multiple_of": 32, "norm_eps": config.rms_norm_eps,
            "rope_theta": config.rope_theta, "max_seq_len": config.max_position_embeddings}


def write_meta_dir(out: Path, config: LlamaConfig, sd: dict[str, torch.Tensor], sp_model: bytes | None,
                   shards: int = 1, vocab_split_dim: int = 1) -> Path:
    """consolidated.NN.pth as Meta's model-parallel code saves them: column-parallel weights split on
    rows, row-parallel ones on columns, the embedding on `vocab_split_dim` (1: Llama 2, 0: Llama 3),
    norms replicated; plus rope.freqs, which Llama 2 checkpoints carry."""
    from minillama.weights import META_NAMES, META_SPLIT_DIM

    out.mkdir(parents=True, exist_ok=True)
    meta = _source_layout(config, sd, META_NAMES)
    d = config.head_dim
    meta["rope.freqs"] = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2).float() / d))
    for k in range(shards):
        part = {}
        for name, t in meta.items():
            kind = name.split(".")[-2]
            if t.dim() < 2 or shards == 1:
                part[name] = t.clone()
                continue
            axis = vocab_split_dim if kind == "tok_embeddings" else META_SPLIT_DIM[kind]
            part[name] = t.chunk(shards, dim=axis)[k].clone()
        torch.save(part, out / f"consolidated.{k:02d}.pth")
    (out / "params.json").write_text(json.dumps(meta_params(config)))
    if sp_model is not None:
        (out / "tokenizer.model").write_bytes(sp_model)
    return out


# --------------------------------------------------------------------------------------------------
# GGUF files


def gguf_tokenizer_metadata(tok: Any) -> dict[str, Any]:
    """tokenizer.ggml.* values for a byte-level BPE `tokenizers.Tokenizer` (pre-tokenizer "smollm")."""
    model = json.loads(tok.to_str())["model"]
    n = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"model": "gpt2", "pre": "smollm", "tokens": tokens, "merges": merges, "types": types,
            "bos": 1, "eos": 2, "add_bos": False, "chat_template": CHATML}


def sp_gguf_tokenizer_metadata(sp_model: bytes) -> dict[str, Any]:
    """tokenizer.ggml.* values for a sentencepiece model, as llama.cpp's converter writes them."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        for k, test in ((2, sp.is_unknown), (3, sp.is_control), (5, sp.is_unused), (6, sp.is_byte)):
            if test(i):
                return k
        return 1

    return {"model": "llama", "tokens": [sp.id_to_piece(i) for i in range(n)],
            "scores": [sp.get_score(i) for i in range(n)], "types": [kind(i) for i in range(n)],
            "bos": sp.bos_id(), "eos": sp.eos_id(), "add_bos": True}


def write_gguf(path: Path, config: LlamaConfig, sd: dict[str, torch.Tensor], tok_meta: dict[str, Any] | None,
               qtype: Any = None, arch: str | None = None, raw: dict[str, tuple[np.ndarray, Any]] | None = None,
               extra: dict[str, Any] | None = None, rope_freqs: np.ndarray | None = None) -> Path:
    """A GGUF as llama.cpp's converter writes it: 2-D weights in `qtype` (default F32), norms and biases
    F32. The architecture follows the config's model type (Llama and Mistral: `llama`) unless `arch` is
    given; linear and yarn RoPE scaling go into `rope.scaling.*`. `raw` replaces named tensors by given
    (bytes, type) pairs, e.g. random K-quant blocks."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from minillama.weights import GGUF_NAMES

    qtype = Q.F32 if qtype is None else qtype
    arch = arch or {"mistral": "llama"}.get(config.model_type, config.model_type)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_dimension_count(config.head_dim)
    if config.head_dim != config.hidden_size // config.num_attention_heads:  # as the converter writes head_dim
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    if tok_meta is not None:
        w.add_tokenizer_model(tok_meta["model"])
        if "pre" in tok_meta:
            w.add_tokenizer_pre(tok_meta["pre"])
        w.add_token_list(tok_meta["tokens"])
        if "merges" in tok_meta:
            w.add_token_merges(tok_meta["merges"])
        if "scores" in tok_meta:
            w.add_token_scores(tok_meta["scores"])
        w.add_token_types(tok_meta["types"])
        w.add_bos_token_id(tok_meta["bos"])
        if tok_meta["eos"] is not None:
            w.add_eos_token_id(tok_meta["eos"])
        if tok_meta["add_bos"] is not None:  # None: no tokenizer.ggml.add_bos_token, as in older files
            w.add_add_bos_token(tok_meta["add_bos"])
        if tok_meta.get("chat_template"):
            w.add_chat_template(tok_meta["chat_template"])
    src = _source_layout(config, sd, GGUF_NAMES, interleave=arch == "llama")
    if rope_freqs is not None:
        src["rope_freqs.weight"] = torch.from_numpy(rope_freqs.astype(np.float32))
    for name, t in src.items():
        a = t.float().numpy()
        if raw and name in raw:
            data, kind = raw[name]
            w.add_tensor(name, data, raw_dtype=kind)
        elif a.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, a)
        elif qtype == Q.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_round_trip(config: LlamaConfig, sd: dict[str, torch.Tensor], qtype: Any) -> dict[str, torch.Tensor]:
    """What a GGUF written with `qtype` holds, back in HF layout: the expected result of loading it."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    from minillama.weights import interleaved_to_half

    out = {}
    for name, t in sd.items():
        if t.dim() == 1 or qtype == Q.F32:
            out[name] = t.clone()
            continue
        n = (config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
             if "k_proj" in name else None)
        a = (half_to_interleaved(t, n) if n else t).numpy()
        a = a.astype(np.float16).astype(np.float32) if qtype == Q.F16 else \
            gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
        w = torch.from_numpy(np.array(a, dtype=np.float32))
        out[name] = interleaved_to_half(w, n) if n else w
    return out


def random_kquant_blocks(qtype: Any, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes in the block layout of a K-quant type, with sane fp16 scales (no inf/NaN)."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    # Where each type keeps its fp16 super-block scales (ggml-common.h): Q4_K/Q5_K d, dmin first;
    # Q6_K d last.
    offsets = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (size - 2,)}[qtype]
    for off in offsets:
        scale = (rng.uniform(0.001, 0.02, size=blocks.shape[0])).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


# --------------------------------------------------------------------------------------------------
# Tokenizers trained here


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Varied text: prose, code, digits, whitespace runs, Unicode and emoji."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over lazy dog river bridge town built metres long question answer "
             "model token layer attention cache weight").split()
    extra = ["naïve café", "Straße", "日本語のテキスト", "🙂🚀", "x² + y² = z²", "def f(x):\n    return x * 2\n",
             "if (a && b) { return 0; }", "3.14159", "2024-01-31", "  two  spaces", "\ttab\t", "\n\n\n"]
    out = []
    for _ in range(n):
        k = rng.randint(3, 12)
        s = " ".join(rng.choice(words) for _ in range(k))
        if rng.random() < 0.6:
            s += " " + rng.choice(extra)
        if rng.random() < 0.3:
            s = s.capitalize() + f" {rng.randint(0, 99999)}."
        out.append(s)
    return out


@functools.lru_cache(maxsize=None)
def sentencepiece_model(vocab: int = 512) -> bytes:
    """A Llama-style sentencepiece BPE model (byte fallback, identity normalization, whitespace kept)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus(600, seed=1)), model_writer=buf, vocab_size=vocab, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        user_defined_symbols=["<sep>"], minloglevel=2, num_threads=1)
    return buf.getvalue()


@functools.lru_cache(maxsize=None)
def byte_bpe_tokenizer(vocab: int = 320) -> Any:
    """A byte-level BPE (`tokenizers`), split the way llama.cpp's "smollm" pre-tokenizer splits."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[AddedToken(s, special=True) for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(600, seed=2), trainer)
    return tok
