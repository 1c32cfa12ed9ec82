"""Any checkpoint in: which format a path holds, its config and state dict, its tokenizer."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from minillama.config import LlamaConfig
from minillama.tokenizer import Tokenizer, TokenizerError, load_tokenizer as _load_tokenizer

from .gguf import _checked_gguf_config, check_gguf_types, gguf_metadata, open_gguf, read_gguf
from .hf import _read_hf_dir, hf_dir_config
from .layout import StateDict, WeightsError
from .meta import _read_meta_dir, meta_config
from .shard import Place, Slices, as_read


CHECKPOINT = "a checkpoint (an HF or Meta directory or a .gguf file)"


def given_path(path: str | Path, what: str = "path", wants: str = CHECKPOINT) -> Path:
    """`path` as a Path; WeightsError for an empty string, which Path would read as the working directory
    (never what an empty string, an unset shell variable, meant)."""
    if isinstance(path, str) and path == "":
        raise WeightsError(f"an empty {what}: give {wants}")
    return Path(path)


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
        _check_entries(p)
        if (p / "config.json").exists():
            return "hf"
        if (p / "params.json").exists():
            return "meta"
        raise WeightsError(f"{p}: neither an HF directory (config.json) nor a Meta directory (params.json)")
    raise WeightsError(f"{p}: {_not_a_file(p)}")


# The files of a checkpoint directory minillama reads (an HF or Meta one, and its tokenizer's), by name or suffix
READ_NAMES = {"config.json", "params.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "tokenizer.model",
              "model.safetensors.index.json"}
READ_SUFFIXES = (".safetensors", ".pth")


def _check_entries(d: Path) -> None:
    """WeightsError naming the first file of `d` minillama would read that is no regular file, or one it may
    not read: a fifo would block the read for ever, a device (`/dev/zero`) never end, a directory, a loop, a
    dangling link or a file without read permission would be reported as some other fault."""
    try:
        names = sorted(os.listdir(d))
    except OSError:  # unreadable: the reader that fails names it
        return
    for name in names:
        if name in READ_NAMES or name.endswith(READ_SUFFIXES):
            f = d / name
            if f.is_dir():
                raise WeightsError(f"{f}: a directory, where a file belongs")
            if not f.is_file():
                raise WeightsError(f"{f}: {_what_is(f)}, where a file belongs")
            try:  # unreadable (permissions): said so, not read by a parser as a corrupt file
                open(f, "rb").close()
            except OSError as e:
                raise WeightsError(f"{f}: cannot be read ({e.strerror or e})") from None


def _not_a_file(p: Path) -> str:
    """What a path that is neither a file nor a directory is, in words (a fifo is not "no such file")."""
    what = _what_is(p)
    if "no such file or directory" in what:  # nothing there, or a link to nothing
        return what
    if what == "a symlink loop":
        return f"{what}, not a checkpoint"
    return f"{what}, not a checkpoint (expected a .gguf file or a directory)"


def _what_is(p: Path) -> str:
    """What a path that is no regular file or directory is: a loop, a dangling link, a fifo, a socket, a device."""
    try:
        mode = os.stat(p).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop"
        return "a symlink to nothing (no such file or directory)" if p.is_symlink() else "no such file or directory"
    return ("a fifo (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def load_state_dict(path: str | Path, slices: Slices | None = None, config: LlamaConfig | None = None,
                    place: Place = as_read) -> tuple[LlamaConfig, StateDict]:
    """Config and HF-named, rotate-half state dict of any supported checkpoint. Tensors keep their
    stored dtype (GGUF tensors are dequantized to float32); lm_head.weight is absent when tied. With
    `slices` (shard.py), the tensors it names are only their parts, and only their bytes are read.
    config: the directory's config as `read_config` decided it, where the caller has it (an HF tie is then
    decided, and a stored head that breaks it said, once). place: where each tensor goes once read, with
    `slices` (its device and dtype: the read one is dropped before the next is read)."""
    fmt = detect_format(path)
    if fmt == "hf":
        return _read_hf_dir(Path(path), slices, config, place)
    if fmt == "meta":
        return _read_meta_dir(Path(path), slices, place)
    config, sd, _ = read_gguf(path, slices, place=place)
    return config, sd


def read_config(path: str | Path, gguf: Any = None) -> LlamaConfig:
    """The config of any supported checkpoint, as loading it decides it, without reading its weights
    (a Meta directory's vocabulary comes from its embedding's shape: the shards are memory-mapped, not read).
    gguf: the file's reader (`open_gguf`) where the caller has opened it: its metadata is slow to parse."""
    fmt = detect_format(path)
    if fmt == "hf":
        return hf_dir_config(Path(path))
    if fmt == "meta":
        return meta_config(Path(path))
    reader = open_gguf(path) if gguf is None else gguf
    check_gguf_types(reader, path)  # before the config, which may read the rope_freqs tensor
    return _checked_gguf_config(gguf_metadata(reader, path), {t.name for t in reader.tensors}, path, reader)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint (directory or .gguf file)."""
    p = Path(path)
    if p.is_dir() and not (p / "tokenizer.json").exists() and not (p / "tokenizer.model").exists():
        raise WeightsError(f"{p}: missing tokenizer (no tokenizer.json or tokenizer.model)")
    try:
        return _load_tokenizer(p)
    except TokenizerError as e:
        raise WeightsError(str(e)) from None
