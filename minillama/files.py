"""Every file minillama writes goes through `write_file`, and every folder it makes through `make_dir`.

A file is written beside its destination under a temporary name and renamed into place, so a reader
never sees half of one and a failed write (a full disk, a read-only folder, a quota) leaves the
destination as it was. Whatever the writer raises for such a failure (`OSError`, or safetensors' own
error type, which wraps the OS's) comes out as one `CannotWrite` line naming the file and the reason.
`json_text` writes JSON that stays valid when a number is NaN or infinite (as `null`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import CannotWrite


def _write_errors() -> tuple[type[BaseException], ...]:
    try:
        from safetensors import SafetensorError
    except ImportError:  # pragma: no cover - safetensors is a dependency
        return (OSError,)
    return (OSError, SafetensorError)


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError):
        return e.strerror or str(e) or type(e).__name__
    m = re.search(r"I/O error: (.*?)(?: \(os error \d+\))?$", str(e))  # safetensors wraps the OS's message
    return m.group(1) if m else " ".join(str(e).split())


def make_dir(path: str | Path) -> Path:
    """`mkdir -p`, with the reason it cannot be made as one `CannotWrite` line."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CannotWrite(p, "exists and is not a folder", what="") from None
    except OSError as e:
        raise CannotWrite(p, _reason(e), what="cannot make the folder") from None
    return p


# The mark in the name of what minillama writes beside its destination before renaming it into place
# (".NAME.minillama-tmp-PID-RANDOM"): a leftover of a killed run is recognized by it, never a user's file.
TEMPORARY = "minillama"


def write_file(path: str | Path, data: str | bytes | Callable[[Path], None]) -> Path:
    """Write `data` (text as UTF-8, bytes, or a function that writes the file at the path it is given) to
    `path`, atomically. Raises `CannotWrite` when the machine refuses; `path` is then unchanged. A symbolic
    link's target is written (the link stays), and the file gets the mode `open` would leave it: an existing
    file's own, a new one's from the umask (safetensors writes its files private, 0600)."""
    p = Path(path)
    if p.is_dir():
        raise CannotWrite(p, "is a folder, not a file", what="")
    target = Path(os.path.realpath(p))
    tmp = target.with_name(f".{target.name}.{TEMPORARY}-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as f:
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)  # a new file's: 0666 less the umask
            if not callable(data):
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
        if target.exists():
            mode = stat.S_IMODE(target.stat().st_mode)
        if callable(data):
            data(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except _write_errors() as e:
        raise CannotWrite(p, _reason(e)) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return p


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def json_text(obj: Any, **kwargs: Any) -> str:
    """`json.dumps`, but valid JSON always: a NaN or infinite number is written as null."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(finite(obj), allow_nan=False, **kwargs)


@contextlib.contextmanager
def utf8_name(path: str | Path) -> Iterator[str]:
    """A name of the file at `path` that libraries taking only UTF-8 paths can open (safetensors' `safe_open`
    called a fine file under a folder named in Latin-1 "truncated or corrupt"): the path itself, or else the
    file opened here and named by its descriptor for as long as the block runs."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        fd = os.open(path, os.O_RDONLY)
        try:
            yield f"/dev/fd/{fd}"
        finally:
            os.close(fd)
        return
    yield name
