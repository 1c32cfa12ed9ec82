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

from minillama import api
from minillama.serve.identity import mismatches
from test_api import QUESTIONS
from _serve_harness import LONG_DOC, serving, write_checkpoint

REQUESTS = int(os.environ.get("MINILLAMA_SERVE_REQUESTS", "24"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def model(ckpt):
    return api.load(ckpt)


def workload(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Random requests: each a route, a body, the client's delay before sending it."""
    out = []
    for _ in range(n):
        kind = rng.choice(["doc", "doc", "chat", "other"])
        question = rng.choice(QUESTIONS) + " " * rng.randint(0, 2) + rng.choice(["", "Briefly.", "Why?"])
        body: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(0 if kind != "chat" else 1, 10),
                                "return_tokens_as_token_ids": True, "ignore_eos": rng.random() < 0.5,
                                "stream": rng.random() < 0.5, "n": rng.choice([1, 1, 2])}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(10**6))
            if rng.random() < 0.3:
                body["top_k"] = rng.randint(1, 40)
            if rng.random() < 0.3:
                body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["stop"] = rng.choice([":", "s i", "El", "3"])  # what this model often writes
        if kind == "chat":
            body.update(messages=[{"role": "system", "content": LONG_DOC}, {"role": "user", "content": question}],
                        logprobs=True, top_logprobs=rng.randint(0, 3))
            route = "/chat/completions"
        else:
            body["logprobs"] = rng.randint(1, 3)
            if kind == "doc":
                body["prompt"] = f"{LONG_DOC}\nQuestion: {question}\nAnswer:"
            else:
                body["prompt"] = [rng.randrange(3, 300) for _ in range(rng.randint(1, 90))]
            body["echo"] = not body["stream"] and rng.random() < 0.6
            route = "/completions"
        out.append({"route": route, "body": body, "delay": rng.random() * 0.6})
    return out


@pytest.mark.parametrize("seed", [0, 1])
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
    the reference's; with the plain kernels behind the server the same check sees a difference."""
    with serving(model) as url:
        out = oracle_json(capsys, url, ckpt)
        assert all(q["passed"] and q["logprob_max"] == 0.0 for q in out["questions"]), out["questions"]
        model.llama.invariant = False
        try:
            plain = oracle_json(capsys, url, ckpt)
        finally:
            model.llama.invariant = True
    assert any(q["logprob_max"] > 0.0 for q in plain["questions"]), plain["questions"]
