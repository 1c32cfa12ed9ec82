"""The serve bench's load generator: `clients` concurrent clients (one asyncio task each) stream every
question once from one OpenAI-compatible server, each asking its next question as soon as its answer is
complete; a round ends when every question is answered or after `limit` seconds (what is unfinished is
dropped and counted as not answered).

Two dialects of the same request (greedy, EOS ignored, `new_tokens` tokens): minillama serve gets token
ids and reports token ids and log-probs (`return_tokens_as_token_ids`); llama-cpp-python's server takes
text only and has no `ignore_eos`, so it gets the prompt's text and `min_tokens = max_tokens` (which masks
EOS until then), and its tokens are counted from the streamed chunks (its usage says how many).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any, Sequence

from .client import empty_answer, fold


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); nan for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def body_for(dialect: str, prompt: list[int] | str, new_tokens: int) -> dict[str, Any]:
    if dialect == "minillama":
        return {"prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}
    return {"prompt": prompt, "max_tokens": new_tokens, "min_tokens": new_tokens, "temperature": 0, "stream": True}


async def ask(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: when it was sent, when each chunk with a token arrived, its tokens
    (minillama: ids and log-probs), text and finish reason. A chunk without text (llama.cpp's last one,
    or a token held back as an incomplete character) counts none."""
    t0 = time.perf_counter()
    times: list[float] = []
    got = empty_answer()
    async with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                had = len(got["tokens"])
                fold(got, c)
                n = len(got["tokens"]) - had if "return_tokens_as_token_ids" in body else int(bool(c.get("text")))
                times += [time.perf_counter()] * n
    return {"start": t0, "times": times, "tokens": got["tokens"], "logprobs": got["lps"], "text": got["text"],
            "finish": got["finish"]}


async def _round(url: str, bodies: list[dict[str, Any]], clients: int, limit: float) -> dict[str, Any]:
    import httpx

    todo = list(range(len(bodies)))
    results: dict[int, dict[str, Any]] = {}

    async def worker(client: Any) -> None:
        while todo:
            i = todo.pop(0)
            results[i] = await ask(client, url, bodies[i])

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=limit, limits=httpx.Limits(max_connections=clients)) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {"wall": time.perf_counter() - t0, "results": results}


def run_round(url: str, bodies: list[dict[str, Any]], clients: int, limit: float) -> dict[str, Any]:
    return asyncio.run(_round(url, bodies, clients, limit))


def summary(r: dict[str, Any], n: int, new_tokens: int) -> dict[str, Any]:
    """Throughput (the tokens of complete answers, `new_tokens` each, over the round's wall time), time to
    first token and time per later token (first to last token over `new_tokens - 1`; p50, p99 over answers)
    of one round. Complete: the answer ended by its length, with every token (minillama: every token id)."""
    ok = {i: x for i, x in r["results"].items() if "error" not in x and x["finish"] == "length" and x["times"]
          and (not x["tokens"] or len(x["tokens"]) == new_tokens)}
    ttft = [x["times"][0] - x["start"] for x in ok.values()]
    per_token = [(x["times"][-1] - x["times"][0]) / (new_tokens - 1) for x in ok.values()] if new_tokens > 1 else []
    tokens = new_tokens * len(ok)
    return {"answered": len(ok), "asked": n, "tokens_per_s": tokens / r["wall"], "wall_s": r["wall"],
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(per_token, 50), "tpot_p99_ms": 1e3 * percentile(per_token, 99)}
