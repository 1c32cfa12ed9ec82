"""HF directories: config.json, model.safetensors (else shards and model.safetensors.index.json), tokenizer
files. Tensors already carry HF's names and rotate-half order, so they load as they are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterable, Mapping

import torch

from minillama.config import LlamaConfig
from minillama.family import hf_fields
from minillama.files import utf8_name

from .layout import HF_NAMES, StateDict, WeightsError, check_state_dict, expected_shapes, map_name
from .shard import CORRUPT, Place, Slices, as_read, read_tensor, safetensors_index


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
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{path}: {e}") from None
    try:
        return LlamaConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{path}: {e}") from None


def _hf_files(d: Path) -> list[Path]:
    """The .safetensors files of an HF directory: model.safetensors, or those its index names, or every one
    (model.safetensors first, as HF transformers takes them when a directory holds both)."""
    index = d / "model.safetensors.index.json"
    if (d / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(f, str) for f in files):
                raise ValueError("shard names must be strings")
            outside = [f for f in files if Path(f).name != f or f in ("", ".", "..")]
            if outside:  # an index names the files beside it, never a path elsewhere
                raise ValueError(f"shard {outside[0]!r} is not a file name in {d}")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({e})") from None
        if not files:
            raise WeightsError(f"{index}: the weight_map names no shards")
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{d}: no .safetensors weights (other weight formats are not supported)")
    for name in files:
        if not (d / name).exists():
            raise WeightsError(f"{d / name}: missing shard named by {index.name}")
    return [d / name for name in files]


def _read_hf_dir(d: Path, slices: Slices | None = None, config: LlamaConfig | None = None,
                 place: Place = as_read) -> tuple[LlamaConfig, StateDict]:
    """Config and state dict; with `slices`, only those parts of the split tensors (shard.py), read at offsets,
    each `place`d as it is read. config: `hf_dir_config(d)`, where the caller has it."""
    from safetensors import safe_open

    # sliced: the tie decided first, from the whole tensors, as every rank must decide it alike
    if config is None:
        config = hf_config(d / "config.json") if slices is None else hf_dir_config(d)
    sd: StateDict = {}
    found: dict[str, Path] = {}
    for f in _hf_files(d):
        if slices is not None:
            part = _read_slices(f, slices, config, place)
        else:
            try:
                with utf8_name(f) as name, safe_open(name, framework="pt") as st:
                    part = {key: st.get_tensor(key) for key in st.keys() if map_name(key, HF_NAMES, f) is not None}
            except WeightsError:
                raise
            except Exception as e:  # safetensors raises SafetensorError for a truncated or corrupt file
                raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None
        _stored_once(f, part, found)  # which copy is meant is not known: one file's would silently win
        found.update(dict.fromkeys(part, f))
        sd.update(part)
    if slices is None:
        _untie_if_head_differs(config, sd, d)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    check_state_dict(config, sd, d, slices)
    return config, sd


def _read_slices(f: Path, slices: Slices, config: LlamaConfig, place: Place = as_read) -> StateDict:
    """The tensors of one .safetensors file, those named in `slices` cut to their parts, each `place`d."""
    try:
        with open(f, "rb") as fh:
            sd, want = {}, expected_shapes(config)
            for key, (offset, shape, dtype) in safetensors_index(fh).items():
                if map_name(key, HF_NAMES, f) is None or (key == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                _check_readable(f, key, dtype)
                if key in slices and shape != want.get(key):  # the whole shape, before it is cut
                    raise WeightsError(f"{f}: tensor {key} has shape {shape} but the config implies "
                                       f"{want.get(key)} (config and weights do not match)")
                sd[key] = place(read_tensor(fh, offset, shape, dtype, slices.get(key)))
            return sd
    except CORRUPT as e:
        raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None


def _stored_once(f: Path, here: Iterable[str], seen: Mapping[str, Path]) -> None:
    """Refuse a tensor of file `f` (names `here`) that file `seen[name]` stores too."""
    again = sorted(set(here) & seen.keys())
    if again:
        raise WeightsError(f"{f}: tensor {again[0]} is stored here and in {seen[again[0]].name}; a checkpoint "
                           "stores each tensor once")


def _check_readable(f: Path, name: str, dtype: torch.dtype | str) -> None:
    """Refuse a needed tensor whose dtype `safetensors_index` gave as a name: one minillama does not read."""
    if isinstance(dtype, str):
        raise WeightsError(f"{f}: tensor {name} has dtype {dtype}, which minillama does not read")


def hf_dir_config(d: Path) -> LlamaConfig:
    """The config of an HF directory as loading it decides it: tie_word_embeddings true with a stored
    lm_head.weight that differs from the embeddings is untied (`_untie_if_head_differs`). Reads no weight,
    except those two in that rare case (every rank of a tensor-parallel run must decide the tie alike)."""
    config = hf_config(d / "config.json")
    if not config.tie_word_embeddings:
        return config
    where, sd = {}, {}
    for f in _hf_files(d):
        try:
            with open(f, "rb") as fh:
                found = {k: (f, *v) for k, v in safetensors_index(fh).items()
                         if k in ("lm_head.weight", "model.embed_tokens.weight")}
        except CORRUPT as e:
            raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None
        _stored_once(f, found, {k: v[0] for k, v in where.items()})  # a tied head is read nowhere else
        where.update(found)
    for key, (f, _, _, dtype) in where.items():
        _check_readable(f, key, dtype)
    if len(where) == 2:
        for key, (f, offset, shape, dtype) in where.items():
            try:
                with open(f, "rb") as fh:
                    sd[key] = read_tensor(fh, offset, shape, dtype)
            except CORRUPT as e:
                raise WeightsError(f"{f}: truncated or corrupt safetensors file ({e})") from None
        _untie_if_head_differs(config, sd, d)
    return config


def _untie_if_head_differs(config: LlamaConfig, sd: StateDict, source: Path) -> None:
    """tie_word_embeddings with an lm_head.weight stored that differs from the embeddings: HF
    transformers keeps the stored head (and warns), so minillama does too, and says so."""
    head, embed = sd.get("lm_head.weight"), sd.get("model.embed_tokens.weight")
    if not config.tie_word_embeddings or head is None or embed is None:
        return
    if head.shape != embed.shape:  # not a head that differs: a head of another shape, which no tie explains
        raise WeightsError(f"{source}: tensor lm_head.weight has shape {tuple(head.shape)} but the config implies "
                           f"{tuple(embed.shape)} (config and weights do not match)")
    if torch.equal(head, embed):
        return
    config.tie_word_embeddings = False
    print(f"warning: {source}: tie_word_embeddings is true but lm_head.weight differs from the embeddings; "
          "using the stored lm_head.weight, as HF transformers does", file=sys.stderr)
