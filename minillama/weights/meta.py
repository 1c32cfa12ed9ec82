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

from .layout import META_NAMES, StateDict, WeightsError, _unpermute_qk, check_state_dict, map_name


# The dimension Meta's model-parallel layers split each 2-D weight on (fairscale's ColumnParallel: 0,
# RowParallel: 1). tok_embeddings is split on 1 in Llama 1/2 (ParallelEmbedding) and on 0 in Llama 3
# (VocabParallelEmbedding); _read_meta_dir tells them apart by shape. 1-D norms are replicated.
META_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "output": 0}


def _read_meta_dir(d: Path) -> tuple[LlamaConfig, StateDict]:
    shards = sorted(d.glob("consolidated.*.pth"))
    if not shards:
        raise WeightsError(f"{d}: no consolidated.NN.pth weights next to params.json")
    parts: list[dict[str, torch.Tensor]] = []
    for f in shards:
        try:
            parts.append(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
        except Exception as e:
            raise WeightsError(f"{f}: truncated or corrupt PyTorch checkpoint ({e})") from None
    try:
        params = json.loads((d / "params.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{d / 'params.json'}: not readable JSON ({e})") from None
    if not isinstance(params, dict):
        raise WeightsError(f"{d / 'params.json'}: must be a JSON object, got a {type(params).__name__}")
    dim = params.get("dim")
    raw: StateDict = {}
    for key in parts[0]:
        pieces = [p[key] for p in parts]
        if any(key not in p for p in parts):
            raise WeightsError(f"{d}: tensor {key!r} is missing from some shards")
        if len(pieces) == 1 or pieces[0].dim() < 2:
            raw[key] = pieces[0]
            continue
        kind = key.split(".")[-2]
        axis = 0 if kind == "tok_embeddings" and pieces[0].shape[1] == dim else META_SPLIT_DIM.get(kind, 1)
        raw[key] = torch.cat(pieces, dim=axis)
    vocab = raw["tok_embeddings.weight"].shape[0] if "tok_embeddings.weight" in raw else None
    try:
        config = LlamaConfig.from_meta_params(d / "params.json", vocab_size=vocab)
    except (KeyError, TypeError, ValueError) as e:
        raise WeightsError(f"{d / 'params.json'}: {e}") from None
    config.tie_word_embeddings = "output.weight" not in raw
    try:  # BOS/EOS ids live in the tokenizer; the weights load without one (load_model will ask)
        tok = load_tokenizer(d / "tokenizer.model")
        config.bos_token_id, config.eos_token_id = tok.bos_id, (tok.eos_ids[0] if tok.eos_ids else None)
    except TokenizerError:
        config.bos_token_id = config.eos_token_id = None
    sd = {}
    for key, t in raw.items():
        name = map_name(key, META_NAMES, d)
        if name is not None:
            sd[name] = _unpermute_qk(name, t, config)
    check_state_dict(config, sd, d)
    return config, sd
