"""`minillama serve`'s promise checked at length: random requests from concurrent clients at random times,
every choice compared with the same request run alone (`generate(..., mode="independent")`).

The serve bench's randomized run (`run`) serves a small model with random weights and the bench model's
tokenizer in this process: solo runs of the bench model itself would take hours on a CPU, and the promise
is about the arithmetic, not the weights. The requests: the bench's document with one of its questions
(a shared 512-token prefix), the question alone as text, or random token ids; greedy or seeded sampling
with top-k / top-p; `n` of 1 or 2; stop strings; echo; streaming or not. The server's KV budget is small
enough that cached document blocks are evicted during the run. The tests (tests/test_serve.py) use the
same generator (`workload`, with chat requests) and comparison (`mismatches`) on a tiny checkpoint.
"""

from __future__ import annotations

import importlib.util
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from .. import api
from ..config import LlamaConfig
from ..generate import generate
from .client import Refused, ask as client_ask

# Plain kernels are not batch-invariant at these shapes (6 heads of 32): a broken promise would show.
IDENTITY_SHAPE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
STOPS = ["e", " the", ".", "a"]  # stop strings random tokens often spell


def eos_of(model: api.LoadedModel) -> list[int]:
    return list(dict.fromkeys([*model.tokenizer.eos_ids, *model.llama.config.eos_token_ids]))


def solo(model: api.LoadedModel, prompt: list[int], n: int, body: dict[str, Any]) -> list[Any]:
    """The request's choices answered alone through `generate(..., mode="independent")`: choice i is
    question i of n copies of the prompt (its random stream (seed, i))."""
    params = api.sampling_params(body.get("max_tokens", 16), body.get("temperature", 1.0), body.get("top_k", 0),
                                 body.get("top_p", 1.0), body.get("seed", 0), body.get("ignore_eos", False),
                                 [body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop", ()),
                                 model.tokenizer)
    return generate(model.llama, [prompt] * n, params, mode="independent", eos_ids=eos_of(model))


def solo_prompt_logprobs(model: api.LoadedModel, prompt: list[int]) -> list[float | None]:
    """Each prompt token's log-prob given the tokens before it, from one stand-alone pass."""
    lp = torch.log_softmax(model.llama(torch.tensor(prompt)).float(), dim=-1)
    return [None] + [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]


def ask(client: Any, url: str, req: dict[str, Any]) -> list[dict[str, Any]]:
    """Send one request (after its `delay`); per choice its token ids, log-probs, text and finish reason,
    streamed or not (client.ask). A refused request or a stream without its end raises client.Refused."""
    time.sleep(req["delay"])
    return client_ask(client, url, req["route"], req["body"])


def mismatches(model: api.LoadedModel, url: str, reqs: list[dict[str, Any]], seen: dict | None = None,
               clients: int | None = None) -> list[str]:
    """Fire the requests from `clients` client threads (default: one each); compare each choice with its
    solo run (tokens, log-probs, finish reason, text; echoed prompt log-probs with one stand-alone pass).
    `seen` counts what the workload exercised (choices, answers cut by a stop string, echoed prompts)."""
    import httpx

    seen = {} if seen is None else seen

    def attempt(client: Any, req: dict[str, Any]) -> Any:
        try:
            return ask(client, url, req)
        except (Refused, httpx.HTTPError) as e:  # refused, cut off or timed out: every choice differs
            return e

    with ThreadPoolExecutor(clients or len(reqs)) as pool, httpx.Client(timeout=600) as client:
        answers = list(pool.map(lambda r: attempt(client, r), reqs))
    tok, bad = model.tokenizer, []
    for k, (req, got) in enumerate(zip(reqs, answers)):
        body = req["body"]
        if isinstance(got, Exception):
            seen["choices"] = seen.get("choices", 0) + body["n"]
            bad += [f"request {k} choice {i}: {req['route']} {body}\n  failed: {type(got).__name__} {got}"[:2000]
                    for i in range(body["n"])]
            continue
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
            seen["choices"] = seen.get("choices", 0) + 1
            tokens, lps, text = g["tokens"], g["lps"], g["text"]
            if stops and a.finish_reason == "stop" and a.token_ids[-1] not in stop_ids:
                seen["stop string"] = seen.get("stop string", 0) + 1
            echo_differs = False
            if body.get("echo"):
                seen["echo"] = seen.get("echo", 0) + 1
                echo_differs = tokens[:len(prompt)] != prompt or \
                    lps[:len(prompt)] != solo_prompt_logprobs(model, prompt)
                tokens, lps = tokens[len(prompt):], lps[len(prompt):]
                text = text[len(body["prompt"]):] if isinstance(body["prompt"], str) else text[len(tok.decode(prompt)):]
            want_text = api.answer_text(tok, a.token_ids, stop_ids, stops)
            if echo_differs or (tokens, lps, g["finish"], text) != (a.token_ids, a.logprobs, a.finish_reason, want_text):
                bad.append(f"request {k} choice {i}: {req['route']} {body}\n  served {tokens} {lps} {g['finish']} "
                           f"{text!r}\n  alone  {a.token_ids} {a.logprobs} {a.finish_reason} {want_text!r}"
                           + ("\n  and the echoed prompt log-probs differ" if echo_differs else ""))
    return bad


def identity_model(tokenizer: Any, context: int, seed: int = 0, device: str = "cpu") -> api.LoadedModel:
    """Random weights at IDENTITY_SHAPE with `tokenizer`'s vocabulary, on `device`."""
    from ..bench.shapes import random_llama
    from ..weights.load import build_model

    config = LlamaConfig(vocab_size=tokenizer.vocab_size, max_position_embeddings=context, **IDENTITY_SHAPE)
    return api.LoadedModel(build_model(config, random_llama(config, seed).state_dict(), device), tokenizer)


def workload(rng: random.Random, n: int, doc_prompts: Sequence[list[int] | str], questions: Sequence[str],
             vocab: int, spread_s: float, *, stops: Sequence[str] = STOPS, chat_system: str | None = None,
             max_tokens: int = 12, echo_rate: float = 0.2) -> list[dict[str, Any]]:
    """n random requests, each sent `delay` seconds after its client is free: a document prompt (ids or
    text), a question alone as text, or random token ids (a quarter each way); greedy or seeded sampling,
    `n` of 1 or 2, stop strings from `stops`, echo, streaming or not. With `chat_system`, the text kind is a
    chat request instead: that system message and one of the questions."""
    out = []
    for _ in range(n):
        kind = rng.choice(["doc", "doc", "text" if chat_system is None else "chat", "ids"])
        body: dict[str, Any] = {"max_tokens": rng.randint(0 if kind != "chat" else 1, max_tokens),
                                "return_tokens_as_token_ids": True,
                                "ignore_eos": rng.random() < 0.5, "stream": rng.random() < 0.5,
                                "n": rng.choice([1, 1, 2]), "logprobs": rng.randint(0, 3)}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=rng.choice([0.7, 1.0, 1.5]), seed=rng.randrange(10**6))
            if rng.random() < 0.3:
                body["top_k"] = rng.randint(1, 40)
            if rng.random() < 0.3:
                body["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            body["stop"] = rng.choice(stops)
        if kind == "chat":  # chat log-probs are a flag and a count of alternatives; no echo
            body.update(messages=[{"role": "system", "content": chat_system},
                                  {"role": "user", "content": rng.choice(questions)}],
                        logprobs=True, top_logprobs=body["logprobs"])
            out.append({"route": "/chat/completions", "body": body, "delay": rng.random() * spread_s})
            continue
        if kind == "doc":
            body["prompt"] = rng.choice(doc_prompts)
        elif kind == "text":
            body["prompt"] = rng.choice(questions)
        else:
            body["prompt"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
        body["echo"] = not body["stream"] and rng.random() < echo_rate
        out.append({"route": "/completions", "body": body, "delay": rng.random() * spread_s})
    return out


def run(tokenizer: Any, doc_prompts: Sequence[list[int]], questions: Sequence[str], requests: int, clients: int,
        seed: int = 0, invariant: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Serve the identity model in this process, on `device`, fire `requests` random requests from `clients`
    concurrent clients, compare every choice with its solo run. `invariant=False` (plain kernels) is the
    control."""
    from .app import build_app
    from .cli import serve_in_thread
    from .engine import Engine

    model = identity_model(tokenizer, max(len(p) for p in doc_prompts) + 128, seed, device)
    model.llama.invariant = invariant
    c = model.llama.config
    kv_per_token = c.kv_bytes_per_token(4)  # float32 keys and values
    # Room for a few documents' worth of keys and values: cached blocks are evicted while the run goes on.
    engine = Engine(model.llama, eos_of(model), max_running=64, max_queue=4096, max_batch_tokens=256,
                    max_memory_bytes=3 * kv_per_token * max(len(p) for p in doc_prompts))
    reqs = workload(random.Random(seed), requests, doc_prompts, questions, tokenizer.vocab_size, spread_s=0.5)
    t0 = time.perf_counter()
    seen: dict[str, int] = {}
    with serve_in_thread(build_app(model, engine, "identity", max_tokens=64, max_body_bytes=1 << 20)) as url:
        bad = mismatches(model, url, reqs, seen, clients)
    stats = engine.stats()
    return {"requests": requests, "clients": clients, "choices": seen.get("choices", 0),
            "identical": seen.get("choices", 0) - len(bad), "stop_string_cuts": seen.get("stop string", 0),
            "echoed": seen.get("echo", 0), "prefix_hit_tokens": stats["prefix_hit_tokens"],
            "evicted_blocks": stats["evicted_blocks"], "wall_s": time.perf_counter() - t0,
            "first_mismatch": bad[0][:2000] if bad else None}


def on_device(device: str, requests: int, clients: int, doc_tokens: int = 256) -> dict[str, Any]:
    """The randomized run served on `device` (gpu_check's `serve` step), with the invariant kernels and, as the
    control, the plain ones: the synthetic task's document and questions, and a byte-level BPE trained here on
    their text (no checkpoint's tokenizer travels to a device). {"skipped": why} where starlette or uvicorn is
    not installed (a device machine's image lacks them: docs/gpu.md says how their wheels travel)."""
    from ..bench.task import TaskConfig, WordTokenizer, make_task, plain_prompt_ids
    from ..tokenizer.bpe import trained_byte_bpe

    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        return {"skipped": f"{' and '.join(missing)} not installed: carry the wheels (docs/gpu.md)"}
    config = TaskConfig(doc_tokens, 1, 8, new_tokens=8)
    stand_in = WordTokenizer(512)  # for the task's text only
    words = make_task(stand_in, config, plain_prompt_ids(stand_in))
    tok = trained_byte_bpe([*words.doc_texts, *words.questions] * 4, vocab_size=400)
    task = make_task(tok, config, plain_prompt_ids(tok))
    return {kernels: run(tok, task.prompts, task.questions, requests, clients, invariant=kernels == "invariant",
                         device=device) for kernels in ("invariant", "plain")}
