"""Any checkpoint in: which format a path holds, its config and state dict, its tokenizer."""

from __future__ import annotations

from pathlib import Path

from minillama.config import LlamaConfig
from minillama.tokenizer import Tokenizer, TokenizerError, load_tokenizer as _load_tokenizer

from .gguf import read_gguf
from .hf import _read_hf_dir
from .layout import StateDict, WeightsError
from .meta import _read_meta_dir


def detect_format(path: str | Path) -> str:
    """"hf", "meta" or "gguf"; raises WeightsError for anything else."""
    p = Path(path)
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return "gguf"
        if p.suffix == ".gguf":
            raise WeightsError(f"{p}: bad magic {magic!r}, not a GGUF file")
        raise WeightsError(f"{p}: not a checkpoint (expected a .gguf file or a directory)")
    if p.is_dir():
        if (p / "config.json").exists():
            return "hf"
        if (p / "params.json").exists():
            return "meta"
        raise WeightsError(f"{p}: neither an HF directory (config.json) nor a Meta directory (params.json)")
    raise WeightsError(f"{p}: no such file or directory")


def load_state_dict(path: str | Path) -> tuple[LlamaConfig, StateDict]:
    """Config and HF-named, rotate-half state dict of any supported checkpoint. Tensors keep their
    stored dtype (GGUF tensors are dequantized to float32); lm_head.weight is absent when tied."""
    fmt = detect_format(path)
    if fmt == "hf":
        return _read_hf_dir(Path(path))
    if fmt == "meta":
        return _read_meta_dir(Path(path))
    config, sd, _ = read_gguf(path)
    return config, sd


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint (directory or .gguf file)."""
    p = Path(path)
    if p.is_dir() and not (p / "tokenizer.json").exists() and not (p / "tokenizer.model").exists():
        raise WeightsError(f"{p}: missing tokenizer (no tokenizer.json or tokenizer.model)")
    try:
        return _load_tokenizer(p)
    except TokenizerError as e:
        raise WeightsError(str(e)) from None
