"""The servers the serve bench measures, each its own process on a free loopback port, started and stopped
by the bench: `minillama serve`, and llama.cpp's OpenAI-compatible server (llama-cpp-python's
`llama_cpp.server`) on an F32 GGUF of the same weights.

Each runs in its own process group with its output in a log file (a pipe nobody reads could fill and
stall it). Start-up is bounded (`start_s`); stopping sends SIGTERM, waits, then kills the whole group, so
nothing is left behind even when a round was cut short.

llama-cpp-python's server has no setting for llama.cpp's extra CPU buffer types, which crash
`llama_decode` on CPUs with AMX (see bench/llamacpp.py): it is started through this module's `__main__`,
which loads models with `use_extra_bufts = False` and then runs `llama_cpp.server` unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

from ..errors import BadInput

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process(args: Sequence[str], probe: str, name: str, start_s: float = 600.0) -> Iterator[subprocess.Popen]:
    """Run `args` until the `with` ends; ready once GET `probe` answers 200 (else a one-line BadInput
    with the end of its log, after at most `start_s` seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryFile("w+") as log:
        p = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + start_s
            while True:
                try:
                    with urllib.request.urlopen(probe, timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if p.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    tail = " ".join(log.read().split())[-400:]
                    why = f"exited with {p.returncode}" if p.poll() is not None else f"not ready in {start_s:g} s"
                    raise BadInput(f"{name} did not start ({why}): {tail}")
                time.sleep(0.5)
            yield p
        finally:
            stop(p)


def stop(p: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM (a server drains), then SIGKILL to its whole process group."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@contextlib.contextmanager
def minillama_server(model: str | None, max_running: int) -> Iterator[tuple[str, int]]:
    """A fresh `minillama serve` (nothing cached); yields its base URL (.../v1) and process id."""
    port = free_port()
    args = [sys.executable, "-m", "minillama.serve", "--port", str(port), "--max-running", str(max_running),
            "--max-queue", "4096", "--drain", "5"]
    if model:
        args += ["--model", model]
    with process(args, f"http://127.0.0.1:{port}/health", "minillama serve") as p:
        yield f"http://127.0.0.1:{port}/v1", p.pid


def llamacpp_available() -> bool:
    try:
        import llama_cpp.server.app  # noqa: F401 (importable, with its server extra)
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def llamacpp_server(gguf: str | Path, n_ctx: int, threads: int) -> Iterator[tuple[str, int]]:
    """A fresh llama-cpp-python server on `gguf` (its defaults but: no interruption of a streaming answer
    by the next request, which would cut answers short; logits of the last token only, as minillama
    computes them; `threads` threads for prompts and decoding); yields its base URL (.../v1) and process id."""
    port = free_port()
    args = [sys.executable, "-m", "minillama.serve.servers", "--model", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch",
            str(threads), "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
    with process(args, f"http://127.0.0.1:{port}/v1/models", "llama.cpp's server") as p:
        yield f"http://127.0.0.1:{port}/v1", p.pid


def _llamacpp_main() -> None:
    """`llama_cpp.server` with models loaded without llama.cpp's extra buffer types."""
    import llama_cpp.llama_cpp as C
    from llama_cpp.server.__main__ import main

    default = C.llama_model_default_params

    def params():  # llama_cpp.Llama reads its model parameters from this function
        p = default()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = params
    main()


if __name__ == "__main__":
    _llamacpp_main()
