"""HF directories: config.json, model.safetensors (or shards and model.safetensors.index.json), tokenizer
files. Tensors already carry HF's names and rotate-half order, so they load as they are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from minillama.config import LlamaConfig
from minillama.family import hf_fields

from .layout import HF_NAMES, StateDict, WeightsError, check_state_dict, map_name


def _is_hf_dir(d: Path) -> bool:
    return (d / "config.json").exists() and any(d.glob("*.safetensors"))


def hf_config(path: str | Path) -> LlamaConfig:
    """LlamaConfig from an HF config.json (Llama, Mistral, Qwen2, Qwen3: family.py), refusing variants
    minillama does not implement."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{path}: not readable JSON ({e})") from None
    try:
        d = hf_fields(d)
    except ValueError as e:
        raise WeightsError(f"{path}: {e}") from None
    params = d.get("rope_parameters")  # transformers 5 writes RoPE settings here
    if isinstance(params, dict):
        d.setdefault("rope_theta", params.get("rope_theta", 10000.0))
        if params.get("rope_type", "default") != "default":
            d.setdefault("rope_scaling", {k: v for k, v in params.items() if k != "rope_theta"})
    try:
        return LlamaConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{path}: {e}") from None


def _read_hf_dir(d: Path) -> tuple[LlamaConfig, StateDict]:
    from safetensors import safe_open

    config = hf_config(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise ValueError("shard names must be strings")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
    elif (d / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{d}: no .safetensors weights (other weight formats are not supported)")
    sd: StateDict = {}
    for name in files:
        f = d / name
        if not f.exists():
            raise WeightsError(f"{f}: missing shard named by {index.name}")
        try:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if map_name(key, HF_NAMES, f) is not None:
                        sd[key] = st.get_tensor(key)
        except WeightsError:
            raise
        except Exception as e:  # safetensors raises SafetensorError for a truncated or corrupt file
            raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None
    _untie_if_head_differs(config, sd, d)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    check_state_dict(config, sd, d)
    return config, sd


def _untie_if_head_differs(config: LlamaConfig, sd: StateDict, source: Path) -> None:
    """tie_word_embeddings with an lm_head.weight stored that differs from the embeddings: HF
    transformers keeps the stored head (and warns), so minillama does too, and says so."""
    head, embed = sd.get("lm_head.weight"), sd.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return
    if head.shape == embed.shape and torch.equal(head, embed):
        return
    config.tie_word_embeddings = False
    print(f"warning: {source}: tie_word_embeddings is true but lm_head.weight differs from the embeddings; "
          "using the stored lm_head.weight, as HF transformers does", file=sys.stderr)
