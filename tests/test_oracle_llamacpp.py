"""The oracle against llama.cpp, for real: in process (llama-cpp-python) and behind llama-cpp-python's
OpenAI-compatible server, on the default model (marked slow; CI installs llama-cpp-python[server]).

Two GGUF files of the same weights: the default Q4_1 file, and an F32 copy made here (every tensor
dequantized, metadata unchanged). llama.cpp's arithmetic differs from minillama's in known ways, and the
oracle must see each: quantized activations on the Q4_1 file (logits within about 1.3), an F16 KV cache
by default (about 2e-2 on the F32 file), and nothing but fp32 rounding (about 6e-5) with an F32 KV cache.

The server is started on a free loopback port with the F32 file: llama-cpp-python's server has no setting
that turns off llama.cpp's extra CPU buffer types, and on CPUs with AMX its AMX code crashes on Q4_1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from minillama import weights
from minillama.oracle.__main__ import main

pytestmark = pytest.mark.slow


def _need(module: str) -> None:
    """Skip without `module` (it takes a 10-20 minute build), except in CI, where .ci/run installs it and
    sets MINILLAMA_REQUIRE_LLAMA_CPP: there a missing llama.cpp is a failure."""
    try:
        __import__(module)
    except ImportError:
        if os.environ.get("MINILLAMA_REQUIRE_LLAMA_CPP"):
            pytest.fail(f"{module} is missing; .ci/run installs llama-cpp-python[server]")
        pytest.skip(f"{module} is not installed (pip install 'llama-cpp-python[server]==0.3.36')",
                    allow_module_level=True)


_need("llama_cpp")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The Q4_1 and F32 GGUF files and a one-question reference record (8 steps)."""
    from _oracle_gguf import dequantized_copy

    weights.fetch_default()
    q4 = weights.default_gguf_path()
    tmp = tmp_path_factory.mktemp("llamacpp")
    f32 = dequantized_copy(q4, tmp / "smollm2-135m-instruct-f32.gguf")
    (tmp / "doc.txt").write_text("The Harbour Bridge in Easton was designed by the engineer Mara Quist and "
                                 "opened in 1932. It is 503 metres long.")
    (tmp / "q.txt").write_text("Who designed the Harbour Bridge?\n")
    ref = tmp / "ref.safetensors"
    assert main(["export", "--doc", str(tmp / "doc.txt"), "--questions", str(tmp / "q.txt"), "-n", "8",
                 "-o", str(ref)]) == 0
    return {"q4": q4, "f32": f32, "ref": ref}


def compare(capsys, files, *args):
    code = main(["compare", "--reference", str(files["ref"]), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_llama_cpp_on_the_q4_1_file_passes_the_quantized_preset(files, capsys):
    capsys.readouterr()
    code, got = compare(capsys, files, "--backend", "llama-cpp", "--backend-model", str(files["q4"]))
    (q,) = got["questions"]
    assert code == 0 and got["tolerances"]["preset"] == "quantized"
    assert 0.1 < q["logit_max"] < 1.5 and q["top_k_overlap"] >= 0.9
    assert "quantized weights" in got["hints"][0]
    # The same run judged as an fp32 implementation fails.
    code, got = compare(capsys, files, "--backend", "llama-cpp", "--backend-model", str(files["q4"]),
                        "--preset", "fp32")
    assert code == 1


def test_llama_cpp_on_the_f32_file_points_at_its_f16_kv_cache(files, capsys):
    capsys.readouterr()
    code, got = compare(capsys, files, "--backend", "llama-cpp", "--backend-model", str(files["f32"]),
                        "--preset", "fp32")
    (q,) = got["questions"]
    assert code == 1 and q["reason"].startswith("logits out of tolerance from step 0")
    assert 1e-3 < q["logit_max"] < 0.1 and q["top_k_overlap"] >= 0.9 and q["first_divergence"] is None
    assert "KV cache in F16" in got["hints"][0]
    # With an F32 KV cache, what is left is fp32 rounding: the cause the hint named.
    code, got = compare(capsys, files, "--backend", "llama-cpp", "--backend-model", str(files["f32"]),
                        "--preset", "fp32", "--kv-cache", "f32")
    assert code == 0 and got["questions"][0]["logit_max"] < 1e-4 and got["hints"] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["f16", "f32"])
def server(request, files, tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on the F32 file, with an F16 (its default) or F32 KV cache."""
    _need("llama_cpp.server.app")
    port = _free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(files["f32"]), "--host", "127.0.0.1",
           "--port", str(port), "--n_ctx", "2048", "--n_threads", str(min(2, os.cpu_count() or 1))]
    if request.param == "f32":
        cmd += ["--type_k", "0", "--type_v", "0"]  # GGML_TYPE_F32
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/models", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"the server did not start: {log.read()[-2000:]}")
                time.sleep(0.5)
        yield request.param, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_openai_backend_against_llama_cpp_server(files, server, capsys):
    kv, url = server
    capsys.readouterr()
    code, got = compare(capsys, files, "--backend", "openai", "--url", url)
    (q,) = got["questions"]
    assert got["tolerances"]["preset"] == "fp32" and "prompts as text" in got["candidate"]["describe"]
    assert q["compared"] == q["steps"] == 8 and q["top_k_overlap"] >= 0.9 and q["first_divergence"] is None
    if kv == "f16":  # llama.cpp's default KV cache: the oracle fails it and names the cause
        assert code == 1 and q["reason"].startswith("logprob of the chosen token out of tolerance from step 0")
        assert 1e-4 < q["logprob_max"] < 0.1 and "KV cache in F16" in got["hints"][0]
    else:
        assert code == 0 and q["logprob_max"] < 1e-4 and got["hints"] == []


def test_oracle_load_against_llama_cpp_server(server, capsys, tmp_path):
    """`oracle load` with text prompts (the server takes no token ids): each probe sent again, or streamed,
    alone gives the same answer; what load and a cold cache do is reported, whatever it is (docs/oracle.md)."""
    from minillama.oracle.__main__ import main as oracle

    _, url = server
    capsys.readouterr()
    code = oracle(["load", "--url", url, "--requests", "4", "--clients", "2", "--max-tokens", "3",
                   "--json", str(tmp_path / "load.json")])
    out, got = capsys.readouterr().out, json.loads((tmp_path / "load.json").read_text())
    assert code == (0 if got["identical"] else 3) and "prompts as text" in out, out
    assert got["causes"]["run_to_run"]["differ"] == got["causes"]["streaming"]["differ"] == 0, out
