"""The Llama family minillama runs: which checkpoints it reads as one decoder, and how their configs map.

Llama, Mistral, Qwen2 and Qwen3 are the same decoder with a few switches (`LlamaConfig`):

- `attention_bias`: biases on q, k, v and o (HF Llama's and Qwen3's flag); Qwen2 always has biases on q, k
  and v and none on o;
- `mlp_bias`: biases on gate, up and down (HF Llama's flag);
- Qwen3: a per-head RMSNorm of q and of k, after the projection and before RoPE;
- `sliding_window` W: a query sees only the keys with `query.position - key.position < W` (HF's mask
  `kv_idx > q_idx - W`): Mistral's, and Qwen's when `use_sliding_window` covers every layer.

A field a model type's HF class does not read is ignored here too (HF Mistral has no biases whatever its
config.json says); a value minillama does not implement is refused in one line naming the field.
Nothing here imports the rest of minillama: config.py and weights/ call in.
"""

from __future__ import annotations

import math
from typing import Any

# HF model type -> the HF class a conversion names in `architectures`.
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
# GGUF architecture (llama.cpp's converter: Llama and Mistral are written as `llama`) -> model type.
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# RoPE types and the keys each needs beside `rope_type` (HF's `rope_scaling` / `rope_parameters`).
ROPE_TYPES = {"default": (), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings"),
              "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",)}
ACTIVATIONS = ("silu", "swish")  # HF maps both names to nn.SiLU
_LAYER_TYPES = ("full_attention", "sliding_attention")  # Qwen's layer_types

# What HF's config class takes for a field config.json leaves out, where it differs from HF Llama's.
# (tests/test_family.py holds each value against transformers' own classes.)
_QWEN = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None}
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"intermediate_size": 14336, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128},
}
# The bias flags each HF class reads (the others ignore them).
_READS = {"llama": ("attention_bias", "mlp_bias"), "mistral": (), "qwen2": (), "qwen3": ("attention_bias",)}


def hf_fields(d: dict[str, Any]) -> dict[str, Any]:
    """config.json's dict as minillama's fields: the model type's defaults, the flags its HF class reads,
    one sliding window or none. Raises ValueError naming the field minillama does not implement."""
    if not isinstance(d, dict):
        raise ValueError(f"a config must be a JSON object, got a {type(d).__name__}")
    model_type = d["model_type"] if "model_type" in d else _type_of_architectures(d.get("architectures"))
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})")
    act = d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    quant = d.get("quantization_config")
    if quant is not None:  # its weights need its scales (or packing) applied: read as they are, they are wrong
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ValueError(f"quantized weights (quantization_config{f', quant_method {method!r}' if method else ''}) "
                         "are not supported: minillama reads unquantized weights (float32, bfloat16, float16) or a "
                         "GGUF file, quantized or not")
    out = {**HF_DEFAULTS[model_type], **d, "model_type": model_type}
    top = d.get("original_max_position_embeddings")
    for key in ("rope_parameters", "rope_scaling") if top is not None else ():
        s = out.get(key)  # a top-level pretraining length (Phi-3's place) wins over the nested one, as in HF 5
        if isinstance(s, dict) and s.get("rope_type", s.get("type")) in ("llama3", "yarn", "longrope"):
            out[key] = {**s, "original_max_position_embeddings": top}
    for flag in ("attention_bias", "mlp_bias"):  # a value not true/false is refused by the config's check
        out[flag] = d[flag] if flag in _READS[model_type] and d.get(flag) is not None else False
    out["sliding_window"] = _window(out, model_type)
    return out


def _type_of_architectures(names: Any) -> str:
    """The model type of a config.json without one: that of the HF class its `architectures` names (which
    `from_pretrained` of that class reads it as), else llama. A class minillama does not run is refused."""
    if names is None or names == []:
        return "llama"
    of_class = {cls: kind for kind, cls in MODEL_TYPES.items()}
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str) or names[0] not in of_class:
        raise ValueError(f"config.json has no model_type and its architectures {names!r} name no model minillama "
                         f"runs (supported: {', '.join(MODEL_TYPES.values())})")
    return of_class[names[0]]


def _window(d: dict[str, Any], model_type: str) -> int | None:
    """The one window all layers share, or None. Mistral's layers all slide unless `layer_types` says which
    (HF then runs it as Ministral, layer by layer); Qwen's layers i >= max_window_layers slide (or
    `layer_types` says which); a mix of windowed and full layers is refused."""
    if model_type == "mistral":
        window, kinds = d.get("sliding_window"), d.get("layer_types")
        if window is None or kinds is None:
            return window
        return _one_window(kinds, window, "sliding_window", "layer_types")
    use = d.get("use_sliding_window")
    if model_type != "llama" and not (use is None or isinstance(use, bool)):
        raise ValueError(f"use_sliding_window must be true or false, got {use!r}")
    if model_type == "llama" or not use:
        return None
    window = d.get("sliding_window", 4096)
    if window is None:
        return None
    n, first, kinds = d.get("num_hidden_layers", 32), d.get("max_window_layers", 28), d.get("layer_types")
    for name, x in (("num_hidden_layers", n), ("max_window_layers", first)):
        if not isinstance(x, int) or isinstance(x, bool):
            raise ValueError(f"{name} must be an integer, got {x!r}")
    if not kinds:  # layers i >= max_window_layers slide
        kinds = ["sliding_attention"] * (first < n) + ["full_attention"] * (min(first, n) > 0)
    return _one_window(kinds, window, "use_sliding_window", "max_window_layers / layer_types")


def _one_window(kinds: Any, window: int, field: str, source: str) -> int | None:
    """`window` if every layer of `kinds` (`layer_types`) slides, None if none does; a mix is refused."""
    if not (isinstance(kinds, list) and all(k in _LAYER_TYPES for k in kinds)):
        raise ValueError(f"layer_types must be a list of {' or '.join(map(repr, _LAYER_TYPES))}, "
                         f"got {str(kinds)[:80]}")
    if set(kinds) <= {"full_attention"}:
        return None
    if set(kinds) == {"sliding_attention"}:
        return window
    raise ValueError(f"{field} with windowed and full layers mixed ({source}) is not supported: minillama runs "
                     "one window for every layer")


def hf_extra(model_type: str, sliding_window: int | None) -> dict[str, Any]:
    """Fields a conversion's config.json needs so that HF reads the same window (Qwen: every layer slides)."""
    if model_type in ("qwen2", "qwen3"):
        return {"use_sliding_window": sliding_window is not None, "max_window_layers": 0}
    return {}


def check_rope_scaling(scaling: dict[str, Any]) -> None:
    """Raise ValueError naming the problem unless minillama implements this RoPE scaling."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in ROPE_TYPES[kind] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {kind!r} lacks {', '.join(missing)}")
    f = scaling.get("factor")
    if kind in ("linear", "dynamic", "yarn") and not (isinstance(f, (int, float)) and not isinstance(f, bool)
                                                      and math.isfinite(f) and f >= 1):
        raise ValueError(f"rope_scaling factor {f!r} must be a finite number >= 1")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope_scaling partial_rotary_factor != 1 (partial RoPE) is not supported")
