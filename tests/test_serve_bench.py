"""The serve bench's parts: the randomized identity run (with its negative control), the load generator's
percentile, bad command lines, and one small bench round trip on the default model with llama.cpp's server
beside minillama serve (marked slow; its numbers are the bench's to report, not a test's to assert).

The round trip leaves llama.cpp's part out only when llama_cpp is not installed, and fails instead when
MINILLAMA_REQUIRE_LLAMA_CPP is set (CI installs llama-cpp-python[server]), as tests/test_oracle_llamacpp.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.serve import identity
from minillama.serve.loadgen import percentile
from minillama.serve.servers import free_port, llamacpp_available
from test_api import DOC, QUESTIONS, tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _identity(invariant: bool) -> dict:
    tok = tiny_tokenizer()
    doc_prompts = [tok.encode(f"{DOC} {DOC}\nQuestion: {q}\nAnswer:", add_special=True) for q in QUESTIONS]
    return identity.run(tok, doc_prompts, QUESTIONS, requests=24, clients=6, invariant=invariant)


def test_the_randomized_identity_run_finds_every_choice_identical():
    got = _identity(True)
    assert got["choices"] >= 24 and got["identical"] == got["choices"], got["first_mismatch"]
    assert got["prefix_hit_tokens"] > 0 and got["echoed"] > 0, got


def test_negative_control_the_randomized_run_sees_plain_kernels():
    got = _identity(False)
    assert got["identical"] < got["choices"] and got["first_mismatch"], got


def test_a_request_that_fails_counts_as_a_difference_for_each_of_its_choices():
    model = identity.identity_model(tiny_tokenizer(), 256)
    reqs = [{"route": "/completions", "delay": 0.0,
             "body": {"prompt": [5, 6], "n": 2, "stream": False, "max_tokens": 1, "ignore_eos": True}}]
    seen: dict = {}
    bad = identity.mismatches(model, f"http://127.0.0.1:{free_port()}/v1", reqs, seen)  # nothing listens there
    assert len(bad) == 2 and seen["choices"] == 2 and "failed: ConnectError" in bad[0], bad


def test_percentile_is_nearest_rank():
    assert (percentile([3, 1, 2, 4], 50), percentile([3, 1, 2, 4], 99), percentile(list(range(100)), 50)) == (2, 4, 49)
    assert percentile([], 50) != percentile([], 50)  # nan


@pytest.mark.parametrize("args, says", [(["--clients", "1,x"], "--clients"), (["--clients", "0"], "at least 1"),
                                        (["--identity-requests", "-1"], "--identity-requests"),
                                        (["--time-limit", "0"], "--time-limit"), (["--bogus"], "--bogus"),
                                        # before the run (it was after it: a traceback, or the results lost)
                                        (["--json", "/nonexistent/b.json"], "does not exist"),
                                        (["--doc-tokens", "9000"], "exceed the model's context (8192)")])
def test_bad_command_lines_are_one_line_errors(args, says):
    p = subprocess.run([sys.executable, "-m", "minillama.serve.bench", *args], capture_output=True, text=True,
                       cwd=ROOT, env=ENV, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


def test_a_checkpoint_whose_gguf_has_no_vocabulary_leaves_llama_cpp_out(tmp_path):
    """llama.cpp's server, sent text, crashed on the F32 GGUF of a checkpoint other than the default model
    (written without a vocabulary): a traceback once minillama's rounds had run, and no results."""
    from minillama.weights import save_hf_dir
    from tiny import tiny_config, tiny_model

    tok = tiny_tokenizer()
    config = tiny_config(vocab=tok.vocab_size, max_pos=512, tied=True)
    ckpt = save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, tmp_path / "tiny")
    p = subprocess.run([sys.executable, "-m", "minillama.serve.bench", "-m", str(ckpt), "--doc-tokens", "32",
                        "--questions", "2", "--new-tokens", "2", "--clients", "1", "--identity-requests", "0"],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["llama_cpp"] is None
    if llamacpp_available():
        assert "its F32 GGUF of this checkpoint has no vocabulary" in p.stderr, p.stderr[-2000:]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_the_bench_runs_both_servers_and_leaves_nothing_behind(tmp_path):
    if not llamacpp_available() and os.environ.get("MINILLAMA_REQUIRE_LLAMA_CPP"):
        pytest.fail("llama_cpp.server is missing; .ci/run installs llama-cpp-python[server]")
    from minillama import weights

    weights.fetch_default()
    p = subprocess.run([sys.executable, "-m", "minillama.serve.bench", "--doc-tokens", "64", "--questions", "4",
                        "--new-tokens", "3", "--clients", "1,4", "--identity-requests", "12", "--identity-clients", "4",
                        "--time-limit", "300", "--json", str(tmp_path / "b.json")],
                       capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads((tmp_path / "b.json").read_text())
    assert [(r["clients"], r["cached"], r["answered"], r["identical"]) for r in out["minillama"]] == \
        [(4, False, 4, 4), (1, True, 4, 4), (4, True, 4, 4)]
    assert out["identity"]["choices"] >= 12 and out["identity"]["identical"] == out["identity"]["choices"]
    assert "| 4 clients, not cached |" in p.stderr
    if llamacpp_available():
        lc = out["llama_cpp"]
        assert lc["prompts_tokenized_alike"] == 4
        assert [(r["clients"], r["cached"], r["answered"]) for r in lc["rounds"]] == \
            [(4, False, 4), (1, True, 4), (4, True, 4)]
        assert all(r["tokens_per_s"] > 0 and "vs_llama_cpp" in r for r in out["minillama"])
        assert len(out["server_pids"]) == 2
    else:
        assert out["llama_cpp"] is None and "llama_cpp is not installed" in p.stderr
    assert all(_gone(pid) for pid in out["server_pids"]), out["server_pids"]
