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
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from minillama import api
from test_api import QUESTIONS
from _serve_harness import LONG_DOC, eos_of, serving, solo, solo_prompt_logprobs, write_checkpoint

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


def ask(client: httpx.Client, url: str, req: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request; per choice its token ids, log-probs, text and finish reason (streamed or not)."""
    time.sleep(req["delay"])
    body, chat = req["body"], req["route"] == "/chat/completions"
    got = [{"tokens": [], "lps": [], "text": "", "finish": None} for _ in range(body["n"])]

    def add(choice: dict[str, Any]) -> None:
        g = got[choice["index"]]
        lp = choice.get("logprobs") or {}
        if chat:
            g["tokens"] += [int(e["token"][9:]) for e in lp.get("content", [])]
            g["lps"] += [e["logprob"] for e in lp.get("content", [])]
            g["text"] += (choice.get("delta") or choice.get("message") or {}).get("content") or ""
        else:
            g["tokens"] += [int(t[9:]) for t in lp.get("tokens", [])]
            g["lps"] += lp.get("token_logprobs", [])
            g["text"] += choice["text"]
        g["finish"] = choice.get("finish_reason") or g["finish"]

    if not body["stream"]:
        r = client.post(url + req["route"], json=body)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            add(c)
        return got
    with client.stream("POST", url + req["route"], json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    for line in lines[:-1]:
        for c in json.loads(line)["choices"]:
            add(c)
    return got


def mismatches(model: api.LoadedModel, url: str, reqs: list[dict[str, Any]], seen: dict | None = None) -> list[str]:
    """Fire every request from its own client thread; compare each choice with its solo run. `seen` counts
    what the workload exercised (answers cut by a stop string, echoed prompts)."""
    seen = {} if seen is None else seen
    with ThreadPoolExecutor(len(reqs)) as pool, httpx.Client(timeout=300) as client:
        answers = list(pool.map(lambda r: ask(client, url, r), reqs))
    tok, bad = model.tokenizer, []
    for k, (req, got) in enumerate(zip(reqs, answers)):
        body = req["body"]
        if req["route"] == "/chat/completions":
            prompt = tok.encode_chat(body["messages"], add_generation_prompt=True)
        elif isinstance(body["prompt"], str):
            prompt = tok.encode(body["prompt"], add_special=True, parse_special=False)
        else:
            prompt = body["prompt"]
        alone = solo(model, prompt, body["n"], body)
        stop_ids = set() if body["ignore_eos"] else set(eos_of(model))
        stops = [body["stop"]] if "stop" in body else []
        for i, (g, a) in enumerate(zip(got, alone)):
            tokens, lps, text = g["tokens"], g["lps"], g["text"]
            if stops and a.finish_reason == "stop" and a.token_ids[-1] not in stop_ids:
                seen["stop string"] = seen.get("stop string", 0) + 1
            if body.get("echo"):
                seen["echo"] = seen.get("echo", 0) + 1
                if tokens[:len(prompt)] != prompt or lps[:len(prompt)] != solo_prompt_logprobs(model, prompt):
                    bad.append(f"request {k} choice {i}: echoed prompt log-probs differ")
                tokens, lps = tokens[len(prompt):], lps[len(prompt):]
                text = text[len(body["prompt"]):] if isinstance(body["prompt"], str) else text[len(tok.decode(prompt)):]
            want_text = api.answer_text(tok, a.token_ids, stop_ids, stops)
            if (tokens, lps, g["finish"], text) != (a.token_ids, a.logprobs, a.finish_reason, want_text):
                bad.append(f"request {k} choice {i}: {req['route']} {body}\n  served {tokens} {lps} {g['finish']} "
                           f"{text!r}\n  alone  {a.token_ids} {a.logprobs} {a.finish_reason} {want_text!r}")
    return bad


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
