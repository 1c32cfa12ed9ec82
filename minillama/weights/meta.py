"""Meta directories: params.json, consolidated.NN.pth (model-parallel shards are concatenated along the
dimension Meta split them on), tokenizer.model. Q and K rows are stored in interleaved RoPE order and are
permuted to rotate-half order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minillama.config import LlamaConfig
from minillama.tokenizer import TokenizerError, load_tokenizer

from .layout import (META_NAMES, StateDict, WeightsError, _unpermute_qk, check_state_dict, expected_shapes,
                     map_name)
from .shard import Place, Slices, as_read


# The dimension Meta's model-parallel layers split each 2-D weight on (fairscale's ColumnParallel: 0,
# RowParallel: 1). tok_embeddings is split on 1 in Llama 1/2 (ParallelEmbedding) and on 0 in Llama 3
# (VocabParallelEmbedding); _read_meta_dir tells them apart by shape. 1-D norms are replicated.
META_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "output": 0}


def _read_meta_dir(d: Path, slices: Slices | None = None, place: Place = as_read) -> tuple[LlamaConfig, StateDict]:
    """Config and state dict; with `slices`, only those parts of the split tensors, cut from the memory-mapped
    shards (`_part`) without joining the whole tensor first; each `place`d as it is cut."""
    config, raw = _open_meta_dir(d)
    sd = {}
    want = expected_shapes(config)
    for key, (pieces, axis) in raw.items():
        name = map_name(key, META_NAMES, d)
        if name is None:
            continue
        if name not in want:
            raise WeightsError(f"{d}: unexpected tensor {name!r} for this config")
        if _shape(pieces, axis) != want[name]:  # the whole shape, before it is cut or its Q/K rows permuted
            raise WeightsError(f"{d}: tensor {name} has shape {_shape(pieces, axis)} but the config implies "
                               f"{want[name]} (config and weights do not match)")
        sd[name] = place(_unpermute_qk(name, _part(pieces, axis, (slices or {}).get(name)), config))
    check_state_dict(config, sd, d, slices)
    return config, sd


def meta_config(d: Path) -> LlamaConfig:
    """The config of a Meta directory; the shards are memory-mapped for their shapes, no weight is read."""
    return _open_meta_dir(d)[0]


def _open_meta_dir(d: Path) -> tuple[LlamaConfig, dict[str, tuple[list[torch.Tensor], int | None]]]:
    """The config, and each tensor's memory-mapped pieces with the axis joining them (None: one piece)."""
    shards = sorted(d.glob("consolidated.*.pth"))
    if not shards:
        raise WeightsError(f"{d}: no consolidated.NN.pth weights next to params.json")
    parts: list[dict[str, torch.Tensor]] = []
    for f in shards:
        try:
            parts.append(torch.load(f, map_location="cpu", weights_only=True, mmap=_is_zip(f)))
        except Exception as e:
            raise WeightsError(f"{f}: truncated or corrupt PyTorch checkpoint ({e})") from None
        _check_shard(f, parts[-1])
    try:
        params = json.loads((d / "params.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{d / 'params.json'}: not readable JSON ({e})") from None
    if not isinstance(params, dict):
        raise WeightsError(f"{d / 'params.json'}: must be a JSON object, got a {type(params).__name__}")
    dim = params.get("dim")
    raw: dict[str, tuple[list[torch.Tensor], int | None]] = {}  # each tensor's pieces and the axis joining them
    for f, part in zip(shards[1:], parts[1:]):  # every shard holds a part (or a copy) of every tensor
        key = next((k for k in parts[0] if k not in part), None)
        if key is not None:
            raise WeightsError(f"{f}: tensor {key!r} is missing ({shards[0].name} holds it)")
        key = next((k for k in part if k not in parts[0]), None)
        if key is not None:
            raise WeightsError(f"{f}: tensor {key!r} is not in {shards[0].name} (every shard holds every tensor)")
    for key in parts[0]:
        pieces = [p[key] for p in parts]
        if len(pieces) == 1 or pieces[0].dim() < 2:
            _check_copies(key, pieces, shards)
            raw[key] = ([pieces[0]], None)
            continue
        kind = key.split(".")[-2]
        axis = 0 if kind == "tok_embeddings" and pieces[0].shape[1] == dim else META_SPLIT_DIM.get(kind, 1)
        for f, p in zip(shards[1:], pieces[1:]):
            if p.dim() != pieces[0].dim() or any(a != b for i, (a, b) in enumerate(zip(p.shape, pieces[0].shape))
                                                 if i != axis):
                raise WeightsError(f"{f}: tensor {key!r} has shape {tuple(p.shape)}, which does not join "
                                   f"{shards[0].name}'s {tuple(pieces[0].shape)} along dimension {axis}")
        raw[key] = (pieces, axis)
    vocab = _shape(*raw["tok_embeddings.weight"])[0] if "tok_embeddings.weight" in raw else None
    try:
        config = LlamaConfig.from_meta_params(d / "params.json", vocab_size=vocab)
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:  # a check missed: still one line
        raise WeightsError(f"{d / 'params.json'}: {e}") from None
    config.tie_word_embeddings = "output.weight" not in raw
    try:  # BOS/EOS ids live in the tokenizer; the weights load without one (load_model will ask)
        tok = load_tokenizer(d / "tokenizer.model")
        config.bos_token_id, config.eos_token_id = tok.bos_id, (tok.eos_ids[0] if tok.eos_ids else None)
    except TokenizerError:
        config.bos_token_id = config.eos_token_id = None
    return config, raw


def _is_zip(f: Path) -> bool:
    """Whether a .pth is in torch.save's zip format (since PyTorch 1.6), the only one torch.load can memory-map;
    an older file is read whole into memory. The test torch.load makes itself: a zip file's first bytes."""
    with open(f, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def _check_shard(f: Path, part: object) -> None:
    """WeightsError naming the file unless it holds what Meta's code saves: a dict of tensor names to tensors."""
    if not isinstance(part, dict):
        raise WeightsError(f"{f}: not a Meta checkpoint (a dict of tensor names to tensors), it holds a "
                           f"{type(part).__name__}")
    if not part:
        raise WeightsError(f"{f}: holds no tensors")
    for key, value in part.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise WeightsError(f"{f}: not a Meta checkpoint (a dict of tensor names to tensors): it maps "
                               f"{repr(key)[:80]} to a value of type {type(value).__name__}")


def _check_copies(key: str, pieces: list[torch.Tensor], shards: list[Path]) -> None:
    """WeightsError naming the shard unless a replicated tensor (a norm, rope.freqs) is the same in every shard:
    only shard 0's copy is read."""
    first = pieces[0]
    for f, p in zip(shards[1:], pieces[1:]):
        if p.shape != first.shape:
            raise WeightsError(f"{f}: tensor {key!r} has shape {tuple(p.shape)} but {shards[0].name} holds it "
                               f"with shape {tuple(first.shape)} (a replicated tensor is the same in every shard)")
        if p.dtype != first.dtype or not torch.equal(p.reshape(-1).view(torch.uint8),
                                                     first.reshape(-1).view(torch.uint8)):  # bits: NaN too
            raise WeightsError(f"{f}: tensor {key!r} differs from {shards[0].name}'s copy (a replicated tensor "
                               "is the same in every shard)")


def _shape(pieces: list[torch.Tensor], axis: int | None) -> tuple[int, ...]:
    shape = list(pieces[0].shape)
    if axis is not None:
        shape[axis] = sum(p.shape[axis] for p in pieces)
    return tuple(shape)


def _part(pieces: list[torch.Tensor], axis: int | None, cut: tuple[int, int, int] | None) -> torch.Tensor:
    """The tensor Meta's shards join along `axis` (None: one piece), or its part `cut` = (dim, start, stop):
    only the pieces' parts inside the cut are copied out of the memory maps. A cut along dimension 1 comes
    back column-major (a row-split weight's layout)."""
    if cut is None:
        return pieces[0] if axis is None else torch.cat(pieces, dim=axis)
    dim, a, b = cut
    if axis is None or axis != dim:
        kept = [p.narrow(dim, a, b - a) for p in pieces]
    else:
        kept, at = [], 0
        for p in pieces:
            lo, hi = max(a, at), min(b, at + p.shape[dim])
            if lo < hi:
                kept.append(p.narrow(dim, lo - at, hi - lo))
            at += p.shape[dim]
    if dim == 1:  # (rows, b - a) column-major: the transposes joined row-major
        return torch.cat([k.t() for k in kept], dim=0 if axis in (None, 1) else 1).t()
    return torch.cat(kept, dim=0 if axis in (None, 0) else axis)
