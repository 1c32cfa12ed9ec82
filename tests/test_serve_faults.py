"""`minillama serve` under limits and faults: 400s that name the field, a full queue (429) that loses and
corrupts nothing, clients that go away mid-answer, SIGTERM while answering, bad command lines, and the
prefix cache's least-recently-used eviction."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from minillama.serve.prefix import PrefixCache
from minillama.serve.identity import solo
from _serve_harness import LONG_DOC, ckpt, model, serving, write_checkpoint  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent


BAD = [  # (route, body, HTTP status, the field the error names)
    ("/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),  # past the context
    ("/completions", {"prompt": [1] * 600}, 400, "prompt"),
    ("/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("/completions", {"prompt": "x", "stop": ""}, 400, "stop"),
    ("/completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/completions", {"prompt": "x", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/completions", {"prompt": "x", "model": ["tiny"]}, 400, "model"),  # a wrong type, not a missing model
    ("/chat/completions", {"messages": []}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ("/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


def test_bad_requests_are_refused_naming_the_field(model):
    with serving(model, api_key="sesame") as url, httpx.Client(timeout=60) as c:
        auth = {"Authorization": "Bearer sesame"}
        for route, body, status, param in BAD:
            r = c.post(url + route, json=body, headers=auth)
            assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
            assert param in r.json()["error"]["message"], r.text
        r = c.post(url + "/completions", content=b"{nope", headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "body")
        r = c.post(url + "/completions", content=b" " * (65 << 10), headers=auth)
        assert (r.status_code, r.json()["error"]["param"]) == (413, "body")
        assert c.post(url + "/completions", json={"prompt": "x"}).status_code == 401
        assert c.get(url + "/models").status_code == 401
        assert c.get(url + "/models", headers=auth).json()["data"][0]["id"] == "tiny"
        assert c.post(url + "/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth).status_code == 200


def test_the_key_is_checked_and_the_schemes_name_is_any_case(model):
    """HTTP's scheme names are case-insensitive: "bearer" was refused (401) where "Bearer" was answered."""
    body = {"prompt": "x", "max_tokens": 1}
    with serving(model, api_key="sesame") as url, httpx.Client(timeout=60) as c:
        codes = [c.post(url + "/completions", json=body, headers={"Authorization": a}).status_code
                 for a in ("Bearer sesame", "bearer sesame", "BEARER  sesame", "Bearer sesam", "Basic sesame",
                           "sesame", "Bearer", "")]
    assert codes == [200, 200, 200, 401, 401, 401, 401, 401]


def test_a_body_refused_unread_closes_its_connection(model):
    """A Content-Length past --max-body is refused before the body is read; the connection, left holding
    the unread body, stayed open until the client gave up waiting."""
    with serving(model) as url:
        host, port = url.split("//")[1].split("/")[0].split(":")
        with socket.create_connection((host, int(port))) as s:
            s.settimeout(30)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 99999999999\r\n\r\n{}")
            reply = b""
            while chunk := s.recv(65536):  # b"": the server closed the connection
                reply += chunk
    head = reply.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head, reply


def test_a_burst_past_the_queue_gets_429_and_the_rest_are_exact(model):
    """Requests past --max-queue are refused at once with 429; bad requests in the burst get 400; every
    answered request still has the bits of its solo run."""
    bodies = [{"prompt": f"{LONG_DOC} {i}", "max_tokens": 6, "ignore_eos": True, "logprobs": 0,
               "return_tokens_as_token_ids": True, "temperature": 0.0 if i % 2 else 1.0, "seed": i}
              for i in range(24)]
    bodies[5] = {"prompt": "x", "top_p": 7}
    with serving(model, max_running=2, max_queue=3) as url, httpx.Client(timeout=120) as c:
        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(lambda b: c.post(url + "/completions", json=b), bodies))
        health = c.get(url[:-3] + "/health").json()
    codes = [r.status_code for r in replies]
    assert codes[5] == 400 and 429 in codes and codes.count(200) >= 3, codes
    assert all("--max-queue" in r.json()["error"]["message"] for r in replies if r.status_code == 429)
    for body, r in zip(bodies, replies):
        if r.status_code == 200:
            a = solo(model, model.tokenizer.encode(body["prompt"], add_special=True, parse_special=False), 1, body)[0]
            lp = r.json()["choices"][0]["logprobs"]
            assert ([int(t[9:]) for t in lp["tokens"]], lp["token_logprobs"]) == (a.token_ids, a.logprobs)
    assert health["running"] == health["waiting"] == 0


def test_a_client_that_goes_away_frees_its_slots(model):
    """Mid-stream and while waiting for a whole answer: the engine drops the request at its next step,
    long before the 250 tokens asked for, and keeps only the cached prefix blocks."""
    body = {"prompt": LONG_DOC, "max_tokens": 250, "ignore_eos": True, "temperature": 0}
    with serving(model) as url, httpx.Client(timeout=120) as c:
        with c.stream("POST", url + "/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        health = lambda: c.get(url[:-3] + "/health").json()  # noqa: E731
        until(lambda: not health()["running"])
        # The whole answer: the client hangs up once the engine runs its request (not after a fixed wait,
        # which a fast machine with the prompt cached outlasts).
        host, port = url.split("//")[1].split("/")[0].split(":")
        data = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
            until(lambda: health()["running"] == 1)
        until(lambda: not health()["running"])
        h = health()
        engine_bytes = h["kv_bytes"]
        per_token = model.llama.config.num_hidden_layers * model.llama.config.num_key_value_heads * \
            model.llama.config.head_dim * 4 * 2
    assert h["running"] == 0 and h["decode_tokens"] < 249, h  # each asked for 249 decode steps
    assert engine_bytes == h["cached_prefix_tokens"] * per_token, h  # only the shared blocks stay


def test_a_client_that_goes_away_mid_body_leaves_no_traceback(model, capfd):
    """A client that closes its connection halfway through sending a body: the request ends quietly (once a
    traceback in the server's log for each such client), and the next client is answered."""
    with serving(model) as url, httpx.Client(timeout=60) as c:
        host, port = url.split("//")[1].split("/")[0].split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\"")
                time.sleep(0.2)  # the server is reading the body when the client goes
        time.sleep(0.5)
        r = c.post(url + "/completions", json={"prompt": "Where is the tower?", "max_tokens": 2})
        assert r.status_code == 200, r.text
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err


def until(ready, seconds: float = 60) -> None:
    t0 = time.monotonic()
    while not ready():
        assert time.monotonic() - t0 < seconds, "the server did not get there in time"
        time.sleep(0.005)


def test_prefix_blocks_are_shared_and_evicted_least_recently_used(model):
    cache = model.llama.new_cache()
    prefix = PrefixCache(cache, block=4)
    a = prefix.acquire(list(range(10)))  # blocks [0..3], [4..7]; tokens 8, 9 are the request's own
    b = prefix.acquire(list(range(8)) + [50, 51])
    assert len(a) == 2 and a == b and a[0].refs == 2
    c = prefix.acquire([0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert c[0] is a[0] and c[1] is not a[1]
    assert c[1].segment in cache.segments and cache.segments[c[1].segment].parent == a[0].segment
    for blocks in (a, b, c):  # fill them, as the engine would, then let them go
        for blk in blocks:
            if not blk.filled:
                cache.append(torch.full((4,), blk.segment), torch.arange(blk.position, blk.position + 4))
                blk.filled = 4
    prefix.release(c)
    prefix.release(a)
    prefix.release(b)  # [4..7] is now the most recently used leaf, [9, 9, 9, 9] the least
    per_block = cache.used_bytes() // 3
    assert prefix.evict(2 * per_block) == 1 and c[1].segment not in cache.segments
    assert prefix.evict(per_block) == 1 and a[1].segment not in cache.segments
    assert prefix.evict(1) == 1 and not cache.segments and not prefix.roots


def test_eviction_releases_the_least_recently_used_leaves_in_order_and_counts_slots(model):
    """`evict` (one scan, then a heap that a parent joins when its last child goes) against its definition,
    a scan of the idle leaves per block released (the least recently used first), on random trees of shared,
    split and partial blocks, some acquired in bursts, and random budgets; and `used_slots` (counted from the
    free slots) against the slots the segments hold."""
    import random

    def build(seed):
        rng, cache = random.Random(seed), model.llama.new_cache()
        prefix = PrefixCache(cache, block=4)
        held = []
        for _ in range(60):
            if held and rng.random() < 0.4:
                prefix.release(held.pop(rng.randrange(len(held))))
                continue
            burst = [[rng.randrange(3) for _ in range(rng.randrange(2, 14))] for _ in range(rng.choice((1, 3)))]
            for chain in prefix.acquire_all(burst):  # some admitted together
                for blk in chain:
                    if blk.filled < len(blk.tokens):
                        n = len(blk.tokens) - blk.filled
                        start = blk.position + blk.filled
                        cache.append(torch.full((n,), blk.segment), torch.arange(start, start + n))
                        blk.filled = len(blk.tokens)
                held.append(chain)
        return prefix, cache

    for seed in range(12):
        (fast, fast_cache), (slow, slow_cache) = build(seed), build(seed)
        assert fast_cache.used_slots == sum(len(g.slots) for g in fast_cache.segments.values()) > 0
        per_slot = fast_cache.bytes_per_token
        for keep in (0.8, 0.5, 0.2, 0.0):
            budget = max(1, int(fast_cache.used_bytes() * keep))
            released = fast.evict(budget)
            n = 0
            while slow_cache.used_bytes() > budget:
                idle = [b for b in slow.blocks.values() if b.refs == 0 and not b.children]
                if not idle:
                    break
                slow._drop(min(idle, key=lambda b: b.used))
                n += 1
            assert released == n and list(fast.blocks) == list(slow.blocks), (seed, keep)
            assert fast_cache.used_slots == sum(len(g.slots) for g in fast_cache.segments.values())
            assert fast_cache.used_bytes() == slow_cache.used_bytes() == fast_cache.used_slots * per_slot


def start_server(ckpt, *extra: str, cwd: Path = ROOT) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "minillama.serve", "--model", str(ckpt), "--port", "0", *extra],
                         stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    line = p.stderr.readline()
    assert "http://" in line, line + p.stderr.read()
    p.stderr_line = line  # the ready line
    return p, line.split()[-1].strip()


def _kill_if_running(p: subprocess.Popen) -> None:
    """A server a failed test left running: killed and reaped, so no process outlives the test."""
    if p.poll() is None:
        p.kill()
        p.wait()


def test_sigterm_lets_the_answer_in_flight_finish_and_exits_0(ckpt):
    p, url = start_server(ckpt)
    try:
        chunks: list[str] = []

        def read():
            body = {"prompt": LONG_DOC, "max_tokens": 60, "ignore_eos": True, "temperature": 0, "stream": True}
            with httpx.stream("POST", url + "/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line[6:])

        failed: list[BaseException] = []

        def read_safely():
            try:
                read()
            except BaseException as e:  # reported below, with what the server said
                failed.append(e)

        reader = threading.Thread(target=read_safely)
        reader.start()
        t0 = time.monotonic()
        while not chunks and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        p.send_signal(signal.SIGTERM)
        reader.join(120)
        code = p.wait(60)
    finally:
        _kill_if_running(p)
    err = p.stderr.read()
    assert code == 0 and not failed, (code, failed, err)
    assert chunks[-1] == "[DONE]" and json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in err and err.strip().endswith("stopped"), err


@pytest.mark.parametrize("drain, signals", [("0", [signal.SIGTERM]), ("60", [signal.SIGINT, signal.SIGINT])])
def test_requests_still_running_when_the_server_stops_get_503_and_an_error_event(ckpt, drain, signals):
    """The drain time up (--drain 0), or a second Ctrl-C: the engine fails what still runs, so a whole answer
    is a 503 in the API's shape and a stream ends with an error event. uvicorn cancelled both handlers first
    (a text/plain 500, a stream cut mid-chunk, two tracebacks in the log)."""
    p, url = start_server(ckpt, "--drain", drain)
    body = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "temperature": 0}
    got: dict[str, object] = {}

    def whole() -> None:
        got["whole"] = httpx.post(url + "/completions", json=body, timeout=120)

    def stream() -> None:
        with httpx.stream("POST", url + "/completions", json={**body, "stream": True}, timeout=120) as r:
            got["stream"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]

    def safely(f):
        def call() -> None:
            try:
                f()
            except BaseException as e:  # reported below, with what the server said
                got.setdefault("failed", []).append(e)
        return call

    clients = [threading.Thread(target=safely(f)) for f in (whole, stream)]
    try:
        for c in clients:
            c.start()
        t0 = time.monotonic()
        while httpx.get(url.removesuffix("/v1") + "/health").json()["running"] < 2 and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        for s in signals:
            p.send_signal(s)
            time.sleep(0.2)
        for c in clients:
            c.join(120)
        code = p.wait(60)
    finally:
        _kill_if_running(p)
    err = p.stderr.read()
    assert code == 0 and "failed" not in got, (code, got, err)
    r = got["whole"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
    assert r.json()["error"] == {"message": "the server is shutting down", "type": "server_error", "param": None,
                                 "code": "shutting_down"}
    assert json.loads(got["stream"][-1])["error"]["message"] == "the server is shutting down", got["stream"][-3:]
    assert "Traceback" not in err and "ERROR" not in err and err.strip() == "minillama serve: stopped", err


def test_a_client_that_reads_no_more_is_closed_after_the_engine_stops(ckpt):
    """A stream whose client takes nothing (its answer fills the socket's buffers) holds its connection open
    past the drain: it is closed STUCK_S after the engine stops, as a client that went away, and the server
    exits 0 with one line and no traceback (uvicorn cancelled its handler with one)."""
    from minillama.serve.cli import STUCK_S

    p, url = start_server(ckpt, "--drain", "0")
    try:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        client.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 16,
                           "logprobs": 20}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()  # 4,000 tokens with 20 top log-probs: megabytes, more than the buffers hold
        while httpx.get(url.removesuffix("/v1") + "/health").json()["decode_tokens"] < 4000:
            assert time.monotonic() - t0 < 120
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = p.wait(STUCK_S + 60)
        took = time.monotonic() - t0
        client.close()
    finally:
        _kill_if_running(p)
    err = p.stderr.read()
    assert code == 0 and STUCK_S <= took, (code, took, err)
    assert "1 connection(s) still sending" in err and "Traceback" not in err and "ERROR" not in err, err
    assert err.strip().endswith("stopped"), err


@pytest.mark.parametrize("args, says", [
    (["--port", "70000"], "--port must be in 0 .. 65535"),
    (["--max-queue", "0"], "--max-queue must be at least 1"),
    (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt: no such file or directory"),
    (["--host", "256.1.1.1"], "--host 256.1.1.1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
    (["--model", "/"], "--model /: a path with no name to serve the model under; give --served-model-name"),
    (["--compile", "--plain-kernels"], "--compile takes the batch-invariant kernels"),
    (["--max-memory", "1e308"], "--max-memory must be a number of MiB from 0 to"),
    # what the environment gives, refused before the model loads, not at every request (HTTP 500s)
    (["MINILLAMA_CPU_GEMM=garbage"], "MINILLAMA_CPU_GEMM='garbage': expected one of auto, onednn, mm"),
    (["MINILLAMA_CPU_16BIT=xyz"], "MINILLAMA_CPU_16BIT='xyz': expected one of auto, native, float32"),
    (["--device", "cuda", "LOCAL_RANK=xyz"], "LOCAL_RANK='xyz' in the environment: the index of this rank's GPU"),
    # keys no client could send ('Authorization' is latin-1 with its ends stripped): refused, not 401 to all
    (["MINILLAMA_API_KEY=  "], "$MINILLAMA_API_KEY: a key no client could send"),
    (["--api-key", " sesame"], "--api-key: a key no client could send"),
    (["--api-key", "\u043a\u043b\u044e\u0447"], "--api-key: a key no client could send"),
])
def test_bad_command_lines_are_one_line_errors(args, says):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.update(a.split("=", 1) for a in args if "=" in a and a[0].isupper())
    args = [a for a in args if not ("=" in a and a[0].isupper())]
    p = subprocess.run([sys.executable, "-m", "minillama", "serve", *args], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


@pytest.mark.parametrize("flags, says", [([], "(KV cache up to 1024 MiB)"),
                                         (["--max-memory", "0"], "(KV cache unbounded)"),
                                         (["--max-memory", "2.5"], "(KV cache up to 2.5 MiB)")])
def test_the_ready_line_gives_the_kv_cache_budget(ckpt, flags, says):
    p, url = start_server(ckpt, *flags)
    try:
        assert says in p.stderr_line and p.stderr_line.rstrip().endswith(url)
    finally:
        p.terminate()
        assert p.wait(60) == 0


@pytest.mark.parametrize("inside, path", [("", "."), ("", "./"), ("sub", "..")])
def test_the_served_name_is_the_checkpoint_folders_however_its_path_is_written(tmp_path, inside, path):
    """`--model .` served the model as '' (and refused requests naming it: "this server has ''"), `..` as '..'."""
    ckpt = write_checkpoint(tmp_path / "my-model")
    (ckpt / "sub").mkdir()
    p, url = start_server(path, cwd=ckpt / inside)
    try:
        assert "model 'my-model'" in p.stderr_line, p.stderr_line
        assert [m["id"] for m in httpx.get(url + "/models").json()["data"]] == ["my-model"]
        r = httpx.post(url + "/completions", json={"prompt": "a", "max_tokens": 1, "model": "my-model"}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "my-model", r.text
    finally:
        p.terminate()
        assert p.wait(60) == 0


def test_a_taken_port_is_a_one_line_error(ckpt):
    p, url = start_server(ckpt)
    try:
        port = url.rsplit(":", 1)[1].split("/")[0]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        q = subprocess.run([sys.executable, "-m", "minillama.serve", "--model", str(ckpt), "--port", port],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert q.returncode == 2 and "cannot bind" in q.stderr and q.stderr.count("\n") == 1, q.stderr
    finally:
        p.terminate()
        assert p.wait(60) == 0


def test_the_command_lines_engine_computes_on_the_thread_that_loaded_the_model(model):
    """`minillama serve` runs the engine's passes on its main thread (where the model was loaded) and the HTTP
    server in another: a CPU's OpenMP runtime keeps one team of workers per calling thread, and passes on a
    second thread ran 1.7x slower (Engine.run). `cli.run` is what the command line calls; SIGTERM ends it."""
    import uvicorn

    from minillama.serve.app import build_app
    from minillama.serve.cli import bind, run
    from minillama.serve.engine import Engine
    from minillama.serve.identity import eos_of

    eng = Engine(model.llama, eos_of(model), max_batch_tokens=64)
    stepped: set[str] = set()
    step = eng._step

    def recorded_step() -> None:
        stepped.add(threading.current_thread().name)
        step()

    eng._step = recorded_step
    app = build_app(model, eng, "tiny", max_tokens=64, start_engine=False)
    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    answers: list[dict] = []

    def client() -> None:
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60:
                try:
                    r = httpx.post(url + "/completions", json={"prompt": LONG_DOC, "max_tokens": 8,
                                                               "temperature": 0}, timeout=60)
                    answers.append(r.json())
                    break
                except httpx.ConnectError:
                    time.sleep(0.02)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=client, daemon=True).start()
    run(uvicorn.Config(app, log_level="warning", lifespan="on"), sock, eng)
    sock.close()
    assert answers and answers[0]["usage"]["completion_tokens"] == 8, answers
    assert stepped == {threading.current_thread().name}, stepped  # every pass on the caller's thread
    assert eng.ended.is_set() and not eng.alive
