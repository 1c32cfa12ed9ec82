"""Checkpoints out: an HF directory written beside its destination and renamed into place (a reader never
sees half of one), replacing only what minillama wrote; `convert` from any supported checkpoint. Temporary
files and directories left by a killed run are recognized by their writer's process id and removed.
`say_at_terminal` (errors.py) is the progress line slow work (downloading, converting) shows at a terminal.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from minillama.config import LlamaConfig
from minillama.errors import CannotWrite, say_at_terminal
from minillama.files import TEMPORARY, make_dir, write_file
from minillama.tokenizer import Tokenizer, TokenizerError

from .layout import StateDict, WeightsError, check_state_dict
from .read import given_path, load_state_dict, load_tokenizer


# Temporary names carry minillama's mark and the writing process's id, so a later run can tell a leftover
# (its writer is dead) from work in progress, and both from a user's own files, which are never removed:
# ".NAME.minillama-tmp-PID-RANDOM" (a directory, or a file from `files.write_file`), ".NAME.minillama-old-..."
_LEFTOVER = re.compile(rf"^\.(.+)\.{TEMPORARY}-(?:tmp|old)-(\d+)-[^/]+$")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True  # no cheap check: never remove what might be in use
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_leftover(p: Path, stem: str = "") -> bool:
    """A temporary file or directory (of output `stem`, or any) whose writer is no longer running."""
    m = _LEFTOVER.match(p.name)
    return m is not None and (not stem or m.group(1) == stem) and not _pid_alive(int(m.group(2)))


def _remove_leftovers(folder: Path, stem: str = "") -> None:
    """Remove temporary files and directories in `folder` whose writer is no longer running."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if not _is_leftover(p, stem):
            continue
        say_at_terminal(f"removing {p}, left by an interrupted run")
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _put_back(out: Path) -> None:
    """A --force run killed between renaming the earlier conversion aside and renaming the new one into place
    left `out` missing and the earlier one in ".NAME.minillama-old-PID-.../NAME": put it back, before the
    leftovers are removed (which would leave neither)."""
    if out.exists() or not out.parent.is_dir():
        return
    for p in sorted(out.parent.iterdir()):
        kept = p / out.name
        aside = p.name.startswith(f".{out.name}.{TEMPORARY}-old-") and _is_leftover(p, out.name)
        if aside and kept.is_dir() and not kept.is_symlink():
            say_at_terminal(f"restoring {out} from {kept}, left by an interrupted run")
            os.replace(kept, out)
            return


def _ready(given: Path, replace: bool) -> None:
    """Raise unless `given` may be written (`check_output_dir`), once an interrupted run's conversion is back."""
    try:
        _put_back(_named(given))
    except OSError as e:
        raise WeightsError(f"{given}: cannot restore the conversion an interrupted run moved aside "
                           f"({e.strerror or e})") from None
    check_output_dir(given, replace)


# What `save_hf_dir` writes: a directory holding only these is a conversion it may replace.
CONVERSION_FILES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "tokenizer.model",
                              "tokenizer_config.json"})


def is_conversion(d: Path) -> bool:
    """A directory `save_hf_dir` could have written: config.json and nothing but the files it writes."""
    names = {p.name for p in d.iterdir()}
    return "config.json" in names and names <= CONVERSION_FILES


def check_output_dir(out: Path, replace: bool = False) -> None:
    """Raise unless `out` may be written: absent, an empty directory, or (with replace) a conversion; a symlink
    to a directory stands for that directory. Nothing that minillama did not write is ever replaced."""
    if out.is_symlink() and not out.exists():
        raise WeightsError(f"{out}: a symlink to nothing (or a loop of links); choose a new directory to write to")
    if out.exists() and not out.is_dir():
        raise WeightsError(f"{out}: exists and is not a directory; choose a new directory to write to")
    if not out.exists() or not any(not _is_leftover(p) for p in out.iterdir()):  # a killed run's files don't count
        return
    if not is_conversion(out):
        raise WeightsError(f"{out}: not empty and not a minillama conversion; refusing to replace it "
                           "(choose a new directory)")
    if not replace:
        raise WeightsError(f"{out}: already holds a conversion; --force replaces it")


def save_hf_dir(config: LlamaConfig, state_dict: StateDict, tokenizer: Tokenizer | None,
                out_dir: str | Path, dtype: torch.dtype | None = None, replace: bool = False) -> Path:
    """Write an HF directory (config.json, model.safetensors, tokenizer files) that minillama and HF
    transformers both load. `out_dir` must be new or empty; with `replace`, it may also be an earlier
    conversion (`check_output_dir`). The directory is written beside and renamed into place (into an empty
    directory: written inside it and its files renamed in, config.json last), so a reader never sees half of
    one, and a failed write (a full disk) leaves `out_dir` as it was. `dtype` casts floating tensors (default:
    keep them)."""
    from safetensors.torch import save_file

    given = Path(out_dir)
    _ready(given, replace)
    check_state_dict(config, {k: v for k, v in state_dict.items()
                              if not (config.tie_word_embeddings and k == "lm_head.weight")}, given)
    out = _named(given)
    tensors = _unshared({k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous()
                         for k, v in state_dict.items() if not (config.tie_word_embeddings and k == "lm_head.weight")})
    stored = {str(v.dtype).removeprefix("torch.") for v in tensors.values() if v.is_floating_point()}
    try:
        make_dir(out.parent)
        _remove_leftovers(out.parent, out.name)
        _remove_leftovers(out)
        # An empty directory stays and is written inside: it may be a mount point, which cannot be renamed, and
        # its parent may be on another filesystem, where a rename is a copy
        home = out if out.is_dir() and not any(out.iterdir()) else out.parent
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{TEMPORARY}-tmp-{os.getpid()}-", dir=home))
    except (OSError, CannotWrite) as e:
        raise WeightsError(f"{given}: cannot write ({getattr(e, 'strerror', None) or e})") from None
    try:
        cfg = {**config.to_dict(), "hidden_act": "silu",
               "torch_dtype": stored.pop() if len(stored) == 1 else "float32"}
        write_file(tmp / "config.json", json.dumps(cfg, indent=2) + "\n")
        write_file(tmp / "model.safetensors", lambda f: save_file(tensors, str(f), metadata={"format": "pt"}))
        if tokenizer is not None:
            tokenizer.save(tmp)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; write_file gave the files the umask's mode
        _move_into_place(tmp, out)
    except (OSError, CannotWrite) as e:  # a full disk, a read-only folder: nothing of the new conversion is left
        why = e.reason if isinstance(e, CannotWrite) else e.strerror or e
        raise WeightsError(f"{given}: cannot write the conversion ({why}); {given} is unchanged") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return given


def _unshared(tensors: StateDict) -> StateDict:
    """Each tensor with bytes of its own: one that shares memory with a tensor before it (a Meta checkpoint whose
    output.weight is its tok_embeddings.weight) is copied. safetensors stores every name's bytes once and refuses
    tensors that overlap; an untied config keeps its two tensors, as HF's converter writes both."""
    seen: set[int] = set()
    out = {}
    for k, v in tensors.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen and v.numel() else v
        seen.add(ptr)
    return out


def _named(out: Path) -> Path:
    """`out` as an absolute path whose last part names the directory itself: `.`, `..` and `sub/..` resolved,
    so that the directories written beside it (in its parent) are not inside it. A symlink to a directory is
    followed: the conversion goes into the directory it names, and the link keeps naming it."""
    return out.resolve() if out.name in ("", "..") or out.is_symlink() else out.parent.resolve() / out.name


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished directory `tmp` to `out`. An earlier `out` (a conversion the caller may replace) is
    first renamed aside and removed only once the new one is in place. A `tmp` inside `out` (which is empty) has
    its files renamed into `out` instead, config.json last: a reader finds a checkpoint only once it is whole."""
    if tmp.parent == out:
        names = sorted((p.name for p in tmp.iterdir()), key=lambda n: n == "config.json")
        moved = []
        try:
            for name in names:
                os.replace(tmp / name, out / name)
                moved.append(name)
        except OSError:
            for name in moved:  # `out` was empty: what is in it now is this conversion's
                (out / name).unlink(missing_ok=True)
            raise
        return
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.{TEMPORARY}-old-{os.getpid()}-", dir=out.parent))
    try:
        os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except OSError:
            os.replace(old / out.name, out)  # put the old one back
            raise
    finally:
        if out.exists():  # in place, the new one or the old one put back: what is aside goes
            shutil.rmtree(old, ignore_errors=True)


def convert(src: str | Path, out_dir: str | Path, replace: bool = False) -> Path:
    """Any supported checkpoint to an HF directory (GGUF tensors are written dequantized, float32).
    `out_dir` must be new or empty; `replace` lets it replace an earlier conversion (never anything else)."""
    src, out = given_path(src, "source path"), given_path(out_dir, "output directory path", "a new or empty directory")
    if src.exists() and out.exists() and (src.resolve() == out.resolve() or out.resolve() in src.resolve().parents):
        raise WeightsError(f"{out}: holds the source {src}; write the conversion to another directory")
    _ready(out, replace)  # before the slow part
    config, sd = load_state_dict(src)
    tok = load_tokenizer(src)
    fits(tok, config)  # a conversion loads: a token id past the model's vocabulary is refused now, not then
    return save_hf_dir(config, sd, tok, out, replace=replace)


def fits(tok: Tokenizer | None, config: LlamaConfig) -> None:
    """WeightsError naming the file and the field when the tokenizer has a token id (or BOS, or only end
    ids) past the model's vocabulary (`Tokenizer.check_fits`), as loading the checkpoint would say."""
    if tok is None:
        return
    try:
        tok.check_fits(config.vocab_size)
    except TokenizerError as e:
        raise WeightsError(str(e)) from None
