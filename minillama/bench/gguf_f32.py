"""The same weights as an F32 GGUF file, so that llama.cpp runs exactly the tensors minillama runs.

llama.cpp reads GGUF only. Quantized weights would compare another model; an F32 file of the very
tensors minillama holds leaves only the two programs' arithmetic apart. The file is what llama.cpp's own
converter writes for a llama checkpoint: `llama.*` metadata, GGUF tensor names, Q and K rows in
interleaved RoPE order (the inverse of `weights.interleaved_to_half`), no `output.weight` when the LM
head is tied, Llama 3 RoPE scaling as a `rope_freqs.weight` tensor. The tokenizer is copied field by
field from a GGUF source when there is one (the default model's original file); without one (random
weights) the file says `no_vocab`, which llama.cpp loads as a model run on token ids only, as the
bench runs every model.

    path = f32_gguf("weights/smollm2-135m-instruct")       # cached beside the directory
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import LlamaConfig
from ..files import make_dir, write_file
from ..weights import GGUF_NAMES, StateDict, WeightsError, default_gguf_path, default_model_dir, llama3_rope_factors, load_state_dict

# HF name -> GGUF name, "{i}" the layer index (the inverse of the reader's map).
TO_GGUF = {hf: g for g, hf in GGUF_NAMES.items() if hf is not None}


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Q or K projection from rotate-half order back to interleaved RoPE order: the inverse of
    `weights.interleaved_to_half`. Row j goes to 2j and row D/2 + j to 2j + 1, in every head."""
    rows, cols = w.shape
    # (rows, cols) -> (H, 2, D/2, cols) -> (H, D/2, 2, cols) -> (rows, cols)
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers."):
        i = parts[2]
        return TO_GGUF[".".join(parts[:2] + ["{i}"] + parts[3:])].replace("{i}", i)
    if hf_name not in TO_GGUF:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    return TO_GGUF[hf_name]


def tokenizer_fields(gguf_path: str | Path) -> list[tuple[str, Any, Any, Any]]:
    """The `tokenizer.*` metadata of a GGUF file as (key, value, type, array element type)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf_path))
    out = []
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((key, f.contents(), f.types[0], sub))
    return out


def write_f32_gguf(config: LlamaConfig, state_dict: StateDict, out: str | Path,
                   tokenizer_from: str | Path | None = None, name: str = "minillama-f32") -> Path:
    """Write `state_dict` (HF names, rotate-half Q/K) as an F32 llama GGUF at `out`, written beside and
    renamed into place so that no reader sees half a file."""
    import gguf

    c = config
    out = Path(out)
    if c.model_type != "llama" or c.attention_bias or c.mlp_bias or c.sliding_window is not None or \
            (c.rope_scaling or {}).get("rope_type", "llama3") != "llama3":
        raise WeightsError(f"{out}: the F32 GGUF is written for plain Llama checkpoints (model_type llama, no "
                           "biases, no window, Llama 3 or no RoPE scaling)")
    make_dir(out.parent)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(name)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_block_count(c.num_hidden_layers)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_rope_dimension_count(c.head_dim)
        w.add_rope_freq_base(c.rope_theta)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_vocab_size(c.vocab_size)
        if tokenizer_from is not None:
            for key, value, vtype, sub in tokenizer_fields(tokenizer_from):
                w.add_key_value(key, value, vtype, sub_type=sub)
        else:
            w.add_tokenizer_model("no_vocab")  # llama.cpp's model without a vocabulary: ids in, logits out
        if c.rope_scaling is not None:
            factors = llama3_rope_factors(c.rope_scaling, c.head_dim, c.rope_theta)
            w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
        for hf_name, t in state_dict.items():
            if c.tie_word_embeddings and hf_name == "lm_head.weight":
                continue  # tied: llama.cpp uses token_embd, as it does for the original file
            t = t.detach().to(torch.float32)
            if hf_name.endswith("self_attn.q_proj.weight"):
                t = half_to_interleaved(t, c.num_attention_heads)
            elif hf_name.endswith("self_attn.k_proj.weight"):
                t = half_to_interleaved(t, c.num_key_value_heads)
            w.add_tensor(gguf_name(hf_name), t.contiguous().numpy())
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return write_file(out, write)


def f32_gguf(model_path: str | Path | None = None, out: str | Path | None = None) -> Path:
    """The F32 GGUF of a checkpoint minillama reads (default: the default model's HF directory), written
    once to `out` (default: beside the checkpoint, `<name>.f32.gguf`) and reused while newer than it.
    The tokenizer comes from the checkpoint itself if it is a GGUF file, from the default model's
    original GGUF for the default directory, else there is none (`no_vocab`)."""
    src = Path(model_path) if model_path is not None else default_model_dir()
    out = Path(out) if out is not None else src.with_name(src.name.removesuffix(".gguf") + ".f32.gguf")
    newest = max((p.stat().st_mtime for p in ([src, *src.iterdir()] if src.is_dir() else [src])), default=0.0)
    if out.is_file() and out.stat().st_mtime >= newest:
        return out
    config, sd = load_state_dict(src)
    return write_f32_gguf(config, sd, out, vocabulary_source(src), name=src.name)


def vocabulary_source(model_path: str | Path | None) -> Path | None:
    """The GGUF file `f32_gguf` takes a checkpoint's vocabulary from: the checkpoint itself if it is one, the
    default model's original file for the default directory; None where there is none (its file is `no_vocab`,
    which llama.cpp runs on token ids only: it cannot tokenize text)."""
    src = Path(model_path) if model_path is not None else default_model_dir()
    if src.suffix == ".gguf":
        return src
    if src.resolve() == default_model_dir().resolve() and default_gguf_path().is_file():
        return default_gguf_path()
    return None
