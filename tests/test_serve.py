"""`minillama serve`'s promise: under any load, a request's tokens and log-probs are those of the same request
run alone (`generate(..., mode="independent")`), compared with `==` on the JSON floats.

Random requests (shared and unshared prefixes, completions and chat, greedy and seeded sampling, n > 1,
stop strings, echo, streaming and not) are fired from concurrent clients at random times at a real server
on loopback. The negative control runs the same workload with the plain kernels and finds differences.
The oracle's HTTP backend, pointed at the server, finds zero difference from minillama's own reference.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import httpx
import pytest

from minillama.serve import identity
from minillama.serve.identity import mismatches
from test_api import QUESTIONS
from _serve_harness import LONG_DOC, ckpt, model, serving  # noqa: F401  (fixtures)

REQUESTS = int(os.environ.get("MINILLAMA_SERVE_REQUESTS", "24"))


# The document's prompts and the chat questions: each question plain, with trailing spaces or a suffix.
ASKED = [q + " " * spaces + suffix for q in QUESTIONS for spaces in range(3) for suffix in ["", "Briefly.", "Why?"]]
DOC_PROMPTS = [f"{LONG_DOC}\nQuestion: {q}\nAnswer:" for q in ASKED]


def workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """The serve bench's random requests (identity.workload) on the tiny checkpoint: document prompts as
    text, chat with the document as the system message, stop strings this model often writes."""
    return identity.workload(rng, n, DOC_PROMPTS, ASKED, vocab=300, spread_s=0.6, stops=[":", "s i", "El", "3"],
                             chat_system=LONG_DOC, max_tokens=10, echo_rate=0.6)


@pytest.mark.parametrize("seed", [0, 2])  # workloads that cut an answer at a stop string and echo (checked)
def test_every_served_answer_equals_its_solo_run(model, seed):
    """The promise, with a KV budget small enough that cached prefixes are evicted during the run."""
    reqs = workload(random.Random(seed), REQUESTS)
    with serving(model, max_memory_bytes=600 * 1024, max_batch_tokens=100) as url:
        seen: dict[str, int] = {}
        bad = mismatches(model, url, reqs, seen)
        stats = httpx.get(url[:-3] + "/health").json()
    assert not bad, "\n".join(bad)
    assert seen.get("stop string") and seen.get("echo"), seen
    assert stats["prefix_hit_tokens"] > 0 and stats["evicted_blocks"] > 0, stats  # reused, and evicted
    assert stats["running"] == stats["waiting"] == 0


def test_negative_control_plain_kernels_break_the_promise(model):
    reqs = workload(random.Random(0), REQUESTS)
    model.llama.invariant = False
    try:
        with serving(model, max_batch_tokens=100) as url:
            bad = mismatches(model, url, reqs)
    finally:
        model.llama.invariant = True
    assert bad, "plain kernels happened to be batch-invariant here: the control shows nothing"


def oracle_json(capsys, url: str, ckpt) -> dict[str, Any]:
    from minillama.oracle.__main__ import main

    capsys.readouterr()
    code = main(["compare", "--backend", "openai", "--url", url, "--model", str(ckpt), "--max-new-tokens", "6",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    return out


def test_the_oracle_finds_zero_difference_through_the_server(model, ckpt, capsys):
    """`minillama oracle compare --backend openai` against `minillama serve`: every echoed log-prob equals
    the reference's; with the plain kernels behind a second server the same check sees a difference (the kernels
    cannot change under a serving engine)."""
    with serving(model) as url:
        out = oracle_json(capsys, url, ckpt)
    assert all(q["passed"] and q["logprob_max"] == 0.0 and q["top_k_overlap"] == 1.0  # named by id
               for q in out["questions"]), out["questions"]
    model.llama.invariant = False
    try:
        with serving(model) as url:
            plain = oracle_json(capsys, url, ckpt)
    finally:
        model.llama.invariant = True
    assert any(q["logprob_max"] > 0.0 for q in plain["questions"]), plain["questions"]
