"""`minillama serve` (also `python -m minillama.serve`): the command line of the OpenAI-compatible server.

    minillama serve --model path/to/ckpt                 # http://127.0.0.1:8000/v1
    minillama serve --host 0.0.0.0 --api-key SECRET      # reachable from elsewhere: ask for a key

Model options and loading are the generate command's (cli.py); device checks, exit statuses and the
one-line errors are every command's (errors.py). Ctrl-C or
SIGTERM stops taking connections, lets the requests in flight finish (at most --drain seconds; those still
running then get a 503, or an error event in their stream), and exits 0.
Exit status 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

from ..cli import add_model_options, load_checkpoint
from ..errors import BadInput, OneLineParser, check_cpu_env, check_device, run_command
from ..waves import DEFAULT_MAX_MEMORY_MB, check_max_memory, memory_budget

if TYPE_CHECKING:
    from .engine import Engine

API_KEY_ENV = "MINILLAMA_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
STUCK_S = 10.0  # once the engine has stopped, how long a request may take to send its end


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillama.serve", allow_abbrev=False,
                      description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, "
                                  "/health) whose answers are bit-identical to each request run alone, "
                                  "whatever else it is serving.")
    add_model_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free port)")
    p.add_argument("--api-key", metavar="KEY", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, if set)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: the "
                   "checkpoint's file or directory name)")
    p.add_argument("--max-memory", type=float, metavar="MB",
                   help="KV cache budget in MiB: requests wait past it, cached prefixes are evicted "
                        f"least-recently-used (default: {DEFAULT_MAX_MEMORY_MB} on a CPU; on a GPU half its memory "
                        "less the model's weights; 0: no bound)")
    p.add_argument("--max-running", type=int, default=64, metavar="N", help="most sequences decoded together (default: 64)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="most sequences waiting; past it requests get HTTP 429 (default: 256)")
    p.add_argument("--max-batch-tokens", type=int, default=512, metavar="N",
                   help="prompt tokens per forward pass, and as many more as fill its last row tile; longer prompts "
                        "take several (default: 512)")
    p.add_argument("--max-tokens", type=int, default=4096, metavar="N", help="most new tokens one choice may ask for (default: 4096)")
    p.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES", help="largest request body (default: 1 MiB)")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt whole (no shared prefixes)")
    p.add_argument("--drain", type=float, default=30.0, metavar="S",
                   help="on Ctrl-C/SIGTERM, seconds to let requests in flight finish; then, or at a second "
                        "Ctrl-C/SIGTERM, those still running get HTTP 503 (default: 30)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: see `errors.run_command` (0, 2 bad input, 130 Ctrl-C, 141 closed pipe, 1 a bug)."""
    return run_command(lambda: _main(argv))


def _check(args: argparse.Namespace) -> None:
    for name in ("max_running", "max_queue", "max_batch_tokens", "max_tokens", "max_body"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.port <= 65535:
        raise BadInput(f"--port must be in 0 .. 65535, got {args.port}")
    check_max_memory(args.max_memory)
    if not (args.drain >= 0) or math.isinf(args.drain):
        raise BadInput(f"--drain must be a number of seconds >= 0, got {args.drain}")
    check_api_key(args.api_key, "--api-key")
    check_api_key(os.environ.get(API_KEY_ENV) if args.api_key is None else None, f"${API_KEY_ENV}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise BadInput("--served-model-name must not be empty")
    check_device(args.device)
    check_cpu_env()


def check_api_key(key: str | None, source: str) -> None:
    """A key a client can send: 'Authorization: Bearer KEY' is read as latin-1 with its ends stripped, so a
    blank key, one with spaces at its ends or one past printable ASCII would refuse every client."""
    if key is None or (key == "" and source.startswith("$")):  # an empty variable: no key, as unset
        return
    if not key:
        raise BadInput(f"{source} must not be empty")
    if key != key.strip() or not all(" " <= c <= "~" for c in key):
        raise BadInput(f"{source}: a key no client could send (blank, spaces at its ends, or a character past "
                       "printable ASCII); use printable ASCII characters")


def served_name(served: str | None, model: str | None, default: str) -> str:
    """The model's name in the API: --served-model-name, else the checkpoint's file or folder name, taken from
    its absolute path (`--model .` names the current folder, not ''; `..` its parent, not '..'; a link keeps
    its own name). A path with no name (the root) is refused, as an empty --served-model-name is."""
    if served is not None:
        return served
    if model is None:
        return default
    name = Path(os.path.abspath(model)).name
    if not name.strip():
        raise BadInput(f"--model {model}: a path with no name to serve the model under; give --served-model-name")
    return name


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads, so a taken port is a one-line error at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise BadInput(f"--host {host}: {e.strerror}") from None
    family, _, proto, _, addr = infos[0]
    # The protocol named (IPPROTO_TCP), not 0: asyncio sets TCP_NODELAY only on sockets that name it, and
    # without it each answer on a kept-alive connection waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise BadInput(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    _check(args)
    try:
        import uvicorn

        from .app import build_app
    except ImportError as e:
        raise BadInput(f"minillama serve needs its extra: pip install 'minillama[serve]' ({e})") from None
    import torch

    from ..weights import DEFAULT_MODEL_NAME
    from .engine import Engine

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    name = served_name(args.served_model_name, args.model, DEFAULT_MODEL_NAME)
    sock = bind(args.host, args.port)
    model = load_checkpoint(args.model, args.device, getattr(torch, args.dtype), invariant=not args.plain_kernels,
                            cuda_graphs=args.cuda_graphs, compiled=args.compile)
    eos = list(dict.fromkeys([*model.tokenizer.eos_ids, *model.llama.config.eos_token_ids]))
    budget = memory_budget(args.max_memory, model.llama)
    engine = Engine(model.llama, eos, max_running=args.max_running, max_queue=args.max_queue,
                    max_batch_tokens=args.max_batch_tokens, max_memory_bytes=budget,
                    prefix_cache=not args.no_prefix_cache)
    app = build_app(model, engine, name, max_tokens=args.max_tokens, api_key=api_key, max_body_bytes=args.max_body,
                    start_engine=False)
    host, port = sock.getsockname()[:2]
    if api_key is None and args.host not in LOOPBACK:
        print(f"warning: --host {args.host} without --api-key (or ${API_KEY_ENV}): anyone who can reach this "
              "machine can use the server", file=sys.stderr)
    kernels = " (plain kernels: an answer may depend on the batch)" if args.plain_kernels else ""
    cache = f"KV cache up to {budget / 2**20:.4g} MiB" if budget else "KV cache unbounded"
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    run(config, sock, engine, f"minillama serve: model {name!r} ({cache}) on http://{host}:{port}/v1{kernels}",
        drain=args.drain)
    print("minillama serve: stopped", file=sys.stderr)
    return 0


@contextlib.contextmanager
def serve_in_thread(app, start_s: float = 60.0) -> Iterator[str]:
    """`app` under uvicorn on 127.0.0.1 (a free port) in a thread of this process; yields its base URL
    (.../v1) and stops it when the `with` ends (the bench's randomized run and the tests use it)."""
    import uvicorn

    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        while not server.started:
            if not thread.is_alive() or time.monotonic() - t0 > start_s:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        if thread.is_alive():
            raise RuntimeError("the in-process server did not stop")


def run(config, sock: socket.socket, engine: Engine, ready: str | None = None, drain: float | None = None) -> None:
    """uvicorn's server on `sock` in a thread, and the engine's loop in this one (the thread that loaded the
    model, whose OpenMP team then runs every pass: `Engine.run`). Ctrl-C/SIGTERM is a normal end: the server
    stops taking connections and lets the requests in flight finish for `drain` seconds (None: as long as
    they take); then, or at a second Ctrl-C/SIGTERM, the engine stops, and each request still running gets
    its 503 (its stream an error event) before uvicorn closes. This returns (exit 0) rather than raising the
    signal again, as uvicorn does. `ready` is printed to stderr once the signals are taken (a SIGTERM sent on
    reading it is a normal end too). `config.timeout_graceful_shutdown` should be None: past it uvicorn cancels
    the requests still running, which answers none of them."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        hurry = False  # a second signal: stop the engine now

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # this thread installs them (uvicorn's are main-only)
            yield

        def handle_exit(self, sig: int, frame) -> None:
            # not uvicorn's force_exit, which skips the wait for the requests and the app's lifespan: a
            # request it leaves running is cancelled with a traceback and no answer
            self.hurry = self.hurry or self.should_exit
            self.should_exit = True

        async def shutdown(self, sockets=None) -> None:
            deadline = asyncio.create_task(self._stop_engine(time.monotonic() + (math.inf if drain is None else drain)))
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

        async def _stop_engine(self, at: float) -> None:
            """At the drain's end the engine fails the sequences still running ("the server is shutting down"),
            and their handlers answer; uvicorn's shutdown, waiting for them, then ends as when they finish."""
            while not self.hurry and time.monotonic() < at:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(engine.stop)
            await asyncio.sleep(STUCK_S)  # a client that takes no more of its answer holds its connection open
            stuck = list(self.server_state.connections)
            if stuck:
                print(f"minillama serve: {len(stuck)} connection(s) still sending {STUCK_S:g} s after the engine "
                      "stopped (a client that reads no more): closed", file=sys.stderr)
                for c in stuck:
                    c.transport.abort()  # as a client that went away: its handler ends (`app._Stream`)

    server = Server(config)

    def serve() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            engine.stop(timeout=0)  # a server that failed to start or has stopped ends the loop too

    old = {s: signal.signal(s, server.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    if ready:
        print(ready, file=sys.stderr, flush=True)
    thread = threading.Thread(target=serve, name="minillama-http", daemon=True)
    try:
        thread.start()
        engine.run()
        server.should_exit = True  # the loop ended first (it does only when stopped): stop serving too
        thread.join()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
