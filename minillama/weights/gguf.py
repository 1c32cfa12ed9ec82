"""GGUF files (llama.cpp), architecture llama, qwen2 or qwen3: the config is the `ARCH.*` metadata (RoPE
scaling included, Llama 3's read back from its `rope_freqs` tensor), tensors are dequantized with
`gguf.quants.dequantize` (llama.cpp's own reference) and `llama` Q/K rows permuted to rotate-half order.
The tokenizer is the `tokenizer.ggml.*` metadata (tokenizer package).
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minillama.config import LlamaConfig
from minillama.family import GGUF_ARCHS

from .layout import GGUF_NAMES, StateDict, WeightsError, _unpermute_qk, check_state_dict, map_name
from .shard import BLOCK_BYTES, Place, Slices, as_read, read_tensor, sliced_shape


def _gguf_types() -> set[Any]:
    from gguf import GGMLQuantizationType as Q

    return {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K}


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader`, with the file's problems as WeightsError."""
    from gguf import GGUFReader

    p = Path(path)
    if not p.is_file():
        raise WeightsError(f"{p}: no such file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise WeightsError(f"{p}: bad magic {magic!r}, not a GGUF file")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # the reader raises ValueError/IndexError on truncated or corrupt files
        raise WeightsError(f"{p}: truncated or corrupt GGUF file ({e})") from None
    expected = 0  # each tensor's data where the ones before it end, aligned: the rule llama.cpp loads by
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise WeightsError(f"{p}: truncated GGUF file (tensor {t.name} has {t.data.nbytes} of "
                               f"{t.n_bytes} bytes)")
        if t.data_offset - reader.data_offset != expected:  # else it reads another tensor's bytes, or a gap
            raise WeightsError(f"{p}: corrupt GGUF file (tensor {t.name} has offset "
                               f"{t.data_offset - reader.data_offset}, expected {expected})")
        expected += -(-int(t.n_bytes) // reader.alignment) * reader.alignment
    return reader


def gguf_metadata(reader: Any, source: str | Path = "GGUF file") -> dict[str, Any]:
    """Every metadata key of the file, key -> value; a string that is not UTF-8 is WeightsError naming the key."""
    from minillama.tokenizer import TokenizerError, gguf_values

    try:
        return gguf_values(reader, str(source))
    except TokenizerError as e:
        raise WeightsError(str(e)) from None


def gguf_config(meta: dict[str, Any], tensor_names: set[str], source: str | Path,
                rope_factors: np.ndarray | None = None) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (llama.cpp's `ARCH.*` keys; ARCH llama, qwen2 or qwen3)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHS:
        raise WeightsError(f"{source}: unsupported architecture {arch!r} (supported: {', '.join(GGUF_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    def f32(name: str, default: float) -> float:
        x = key(name, default)
        if not isinstance(x, numbers.Real) or isinstance(x, bool):
            raise ValueError(f"{arch}.{name} must be a number, got {x!r}")
        return float(str(np.float32(x)))  # GGUF stores float32: 1e-5 reads back as 9.99999974e-06

    def count(name: str, default: Any = None) -> Any:
        x = key(name, default)
        if x is not None and not (isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1):
            raise ValueError(f"{arch}.{name} must be an integer >= 1, got {x!r}")
        return x

    if key("expert_count", 0):
        raise WeightsError(f"{source}: mixture-of-experts {arch} ({arch}.expert_count) is not supported")
    hidden, heads = count("embedding_length"), count("attention.head_count")
    if hidden is None or heads is None or key("block_count") is None or key("context_length") is None:
        raise WeightsError(f"{source}: incomplete {arch} metadata (embedding_length, attention.head_count, "
                           "block_count and context_length are required, as llama.cpp requires them)")
    head_dim = count("attention.key_length") or hidden // heads
    if count("rope.dimension_count", head_dim) != head_dim:
        raise WeightsError(f"{source}: {arch}.rope.dimension_count {key('rope.dimension_count')} is not the head "
                           f"dim {head_dim}: partial RoPE is not supported")
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) or None
    theta = f32("rope.freq_base", 10000.0)
    scaling = _gguf_rope_scaling(key, rope_factors, head_dim, theta, source)
    if key("attention.sliding_window"):
        raise WeightsError(f"{source}: {arch}.attention.sliding_window is not supported in GGUF files "
                           "(an HF directory's sliding_window is)")
    try:
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"), num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
            rms_norm_eps=f32("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=theta,
            rope_scaling=scaling, tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=key("context_length", 2048), model_type=GGUF_ARCHS[arch],
            attention_bias=any(n.endswith("attn_output.bias") for n in tensor_names),
            mlp_bias=any(n.endswith("ffn_gate.bias") for n in tensor_names),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{source}: {e}") from None


def _gguf_rope_scaling(key: Any, rope_factors: np.ndarray | None, head_dim: int, theta: float,
                       source: str | Path) -> dict[str, Any] | None:
    """HF's rope_scaling from what llama.cpp's converter writes: `rope.scaling.type` linear or yarn with
    `rope.scaling.factor` (and yarn's original context), or Llama 3's factors in a `rope_freqs` tensor."""
    def number(name: str, kind: type = numbers.Real) -> Any:
        x = key(name)
        if x is not None and (not isinstance(x, kind) or isinstance(x, bool)):
            raise ValueError(f"{name} must be {'an integer' if kind is numbers.Integral else 'a number'}, got {x!r}")
        return x

    factor = number("rope.scaling.factor") if key("rope.scaling.factor") is not None else number("rope.scale_linear")
    factor = 1.0 if factor is None or factor == 0 else factor  # 0: unscaled, as llama.cpp reads it
    # As llama.cpp reads it too: no type is linear (older files: rope.scale_linear alone); "none" never scales.
    kind = key("rope.scaling.type", "linear" if factor != 1.0 else "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor)}
        if number("rope.scaling.original_context_length", numbers.Integral):
            out["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for name in ("beta_fast", "beta_slow"):
            if number(f"rope.scaling.yarn_{name}") is not None:
                out[name] = float(key(f"rope.scaling.yarn_{name}"))
        # llama.cpp's own yarn knobs, at the values that leave HF's yarn as it is; anything else is refused.
        neutral = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_ext_factor": (-1.0, 1.0),
                   "yarn_log_multiplier": (0.0,)}
        for name, ok in neutral.items():
            if key(f"rope.scaling.{name}") not in (None, *ok):
                raise WeightsError(f"{source}: rope.scaling.{name} {key(f'rope.scaling.{name}')} is not "
                                   "supported (only HF's yarn)")
        return out
    if kind != "none":
        raise WeightsError(f"{source}: rope.scaling.type {kind!r} is not supported "
                           "(supported: linear, yarn, and llama3's rope_freqs)")
    return None if rope_factors is None else llama3_scaling_from_factors(rope_factors, head_dim, theta, source)


def llama3_rope_factors(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """Per-frequency divisors of Llama 3 RoPE scaling, as llama.cpp writes them into `rope_freqs`."""
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def llama3_scaling_from_factors(factors: np.ndarray, head_dim: int, theta: float,
                                source: str | Path) -> dict[str, Any]:
    """The Llama 3 `rope_scaling` a GGUF `rope_freqs` tensor was written from. The factors only fix
    the ratios of original_max_position_embeddings to the two frequency factors, so 8192 (Llama 3's)
    is taken and the factors solved from the smoothly interpolated band; checked by recomputing.

    A band of two or more frequencies fixes both factors. With one frequency (or none) in the band, many
    pairs give the same factors, so the same model: one is taken with the band's frequency as far from
    either edge as its neighbours allow."""
    f = np.asarray(factors, dtype=np.float64)
    if f.shape != (head_dim // 2,):  # one factor per rotated pair of dimensions
        raise WeightsError(f"{source}: rope_freqs.weight has shape {tuple(f.shape)}, expected ({head_dim // 2},): "
                           f"one factor per pair of the head's {head_dim} dimensions")
    factor, old = float(f.max()), 8192
    a = old / (2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    s = (1 / f[band] - 1 / factor) / (1 - 1 / factor)  # smooth, linear in a: s = (a - lo) / (hi - lo)
    if factor > 1 and band.sum() >= 2:
        slope, icept = np.polyfit(a[band], s, 1)
        lo, hi = float(f"{-icept / slope:.6g}"), float(f"{(1 - icept) / slope:.6g}")
    elif factor > 1:
        # Kept frequencies need a > hi, fully scaled ones a < lo, the band's lo <= a <= hi.
        kept, scaled = a[f <= 1 + 1e-6], a[f >= factor * (1 - 1e-6)]
        a_hi = float(kept.min()) if kept.size else math.inf
        a_lo = float(scaled.max()) if scaled.size else 0.0
        if band.sum() == 1:
            ab, sb = float(a[band][0]), float(s[0])
            width = 0.5 * min((ab - a_lo) / sb if sb > 0 else math.inf,
                              (a_hi - ab) / (1 - sb) if sb < 1 else math.inf)
            lo, hi = ab - sb * width, ab + (1 - sb) * width
        else:
            span = a_hi - a_lo if a_hi < math.inf else 3 * a_lo  # no band: any lo < hi between the two sides
            lo, hi = a_lo + span / 3, a_lo + 2 * span / 3
    if factor > 1 and 0 < lo < hi < math.inf:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                   "original_max_position_embeddings": old}
        if np.allclose(llama3_rope_factors(scaling, head_dim, theta), f, rtol=1e-5, atol=0):
            return scaling
    raise WeightsError(f"{source}: rope_freqs.weight does not follow Llama 3 RoPE scaling; not supported")


def _rope_factors(reader: Any) -> np.ndarray | None:
    from gguf.quants import dequantize

    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else dequantize(t.data, t.tensor_type).reshape(_shape(t))


def _checked_gguf_config(meta: dict[str, Any], names: set[str], source: str | Path, reader: Any) -> LlamaConfig:
    """`gguf_config`, with metadata of the wrong type (a string where a count belongs) as WeightsError."""
    try:
        return gguf_config(meta, names, source, _rope_factors(reader))
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise WeightsError(f"{source}: llama metadata of the wrong type or value ({e})") from None


def _shape(t: Any) -> tuple[int, ...]:
    """A GGUF tensor's shape as numpy and torch hold it: GGUF lists dimensions fastest-first, (rows, cols) here."""
    return tuple(int(n) for n in reversed(t.shape.tolist()))


def check_gguf_types(reader: Any, path: str | Path) -> None:
    """WeightsError naming the first tensor of a type minillama cannot read (its table alone)."""
    supported = _gguf_types()
    for t in reader.tensors:
        if t.tensor_type not in supported:
            raise WeightsError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name} "
                               f"(supported: {', '.join(sorted(q.name for q in supported))})")


def check_gguf_layout(reader: Any, path: str | Path, config: LlamaConfig) -> None:
    """WeightsError for a tensor missing, unexpected or of another shape than the config implies, from the
    file's tensor table alone (nothing dequantized): what `read_gguf` would refuse after reading every tensor."""
    shapes = {name: torch.empty(_shape(t), device="meta")
              for t in reader.tensors if (name := map_name(t.name, GGUF_NAMES, path)) is not None}
    check_state_dict(config, shapes, path)


def read_gguf(path: str | Path, slices: Slices | None = None, reader: Any = None,
              place: Place = as_read) -> tuple[LlamaConfig, StateDict, dict[str, Any]]:
    """Config, dequantized HF-layout state dict (float32) and raw metadata of a llama GGUF file; with
    `slices`, only those parts of the split tensors, read at their offsets (`_read_part`). reader: the file's
    `open_gguf`, where the caller has opened it. place: where each part goes once read (with `slices`)."""
    from gguf.quants import dequantize

    reader = open_gguf(path) if reader is None else reader
    meta = gguf_metadata(reader, path)
    check_gguf_types(reader, path)
    config = _checked_gguf_config(meta, {t.name for t in reader.tensors}, path, reader)
    check_gguf_layout(reader, path, config)  # every whole shape, before any tensor is read or cut
    sd: StateDict = {}
    for t in reader.tensors:
        name = map_name(t.name, GGUF_NAMES, path)
        if name is None:
            continue
        shape = _shape(t)
        if slices is not None:
            with open(path, "rb") as f:
                sd[name] = place(_unpermute_qk(name, _read_part(f, t, shape, slices.get(name)), config))
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only file map
            w = w.copy()
        sd[name] = _unpermute_qk(name, torch.from_numpy(w), config)
    check_state_dict(config, sd, path, slices)
    return config, sd, meta


def _read_part(f: Any, t: Any, shape: tuple[int, ...], cut: tuple[int, int, int] | None) -> torch.Tensor:
    """A tensor's part `cut` (or all of it) in float32, read from the file at its offset (shard.py).

    Quantized rows are blocks of `block` values in `size` bytes, dequantized a block of rows at a time (so
    that the dequantizer's temporaries stay small). A slice of rows reads its rows; a slice of columns that
    starts and stops on block boundaries reads only its blocks of each row. Another column slice reads and
    dequantizes whole rows and keeps its columns: the tensor's bytes pass through (tp times the slice's), but
    no more than a block of rows is held."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
    from gguf.quants import dequantize

    plain = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
    if t.tensor_type in plain:
        return read_tensor(f, t.data_offset, shape, plain[t.tensor_type], cut).float()
    block, size = GGML_QUANT_SIZES[t.tensor_type]
    rows, cols = shape if len(shape) == 2 else (1, shape[0])
    row_bytes = cols // block * size

    def values(r0: int, r1: int, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """Rows r0 .. r1-1 (of the bytes `part` of each) dequantized: (r1 - r0, values) float32."""
        raw = read_tensor(f, t.data_offset + r0 * row_bytes, (r1 - r0, row_bytes), torch.uint8, part)
        return torch.from_numpy(dequantize(raw.contiguous().numpy(), t.tensor_type).astype(np.float32, copy=False))

    step = max(1, BLOCK_BYTES // (4 * cols))
    if cut is None or cut[0] == 0:
        lo, hi = (0, rows) if cut is None else cut[1:]
        out = torch.empty(hi - lo, cols)
        for r0 in range(lo, hi, step):
            out[r0 - lo:min(hi, r0 + step) - lo] = values(r0, min(hi, r0 + step))
        return out.reshape(sliced_shape(shape, cut))
    _, a, b = cut
    aligned = a % block == 0 and (b % block == 0 or b == cols)
    out = torch.empty(b - a, rows)  # column-major (rows, b - a), as out.t(): a row-split weight's layout
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        part = values(r0, r1, (1, a // block * size, -(-b // block) * size)) if aligned else values(r0, r1)[:, a:b]
        out[:, r0:r1] = part.t()
    return out.t()
