"""`python -m minillama.serve.bench`: `minillama serve` under 1, 8, 32, 64 concurrent clients, against one
parallel pass of `generate` on the same questions about one document.

    python -m minillama.serve.bench --model PATH [--doc-tokens 512] [--questions 64] [--new-tokens 16]

The questions are the benchmark's synthetic task (bench/task.py): one document, questions about its facts.
The parallel pass runs first, in this process; then the server runs as its own process on a free loopback
port, and for each client count that many clients (one asyncio task each) stream every question once,
each client asking its next question as soon as its answer is complete. Reported per client count:
generated tokens per second (all answers over the wall time of the round), time to first token and time
per later token (p50, p99), and how many answers are identical (token ids and log-probs) to the parallel
pass's, which parallel prompting makes identical to each question's solo run. The server keeps its cached
document blocks between rounds, as a server would. Bounded: `--time-limit` seconds per round, after which
the round's unfinished requests are dropped and counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..files import write_file
from ..errors import BadInput, OneLineParser


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillama.serve.bench", allow_abbrev=False,
                      description="minillama serve under concurrent clients against one parallel generate pass")
    p.add_argument("--model", "-m", metavar="PATH", help="checkpoint (default: the default model)")
    p.add_argument("--doc-tokens", type=int, default=512, help="document length in tokens (default: 512)")
    p.add_argument("--questions", type=int, default=64, help="questions about the document (default: 64)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per answer, EOS ignored (default: 16)")
    p.add_argument("--clients", default="1,8,32,64", help="concurrent client counts (default: 1,8,32,64)")
    p.add_argument("--time-limit", type=float, default=600.0, metavar="S", help="most seconds per round (default: 600)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank); nan for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def _ask(client: Any, url: str, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}
    t0 = time.perf_counter()
    times, tokens, lps = [], [], []
    async with client.stream("POST", url + "/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                lp = c.get("logprobs") or {}
                got = [int(t[9:]) for t in lp.get("tokens", [])]
                tokens += got
                lps += lp.get("token_logprobs", [])
                times += [time.perf_counter()] * len(got)
    return {"start": t0, "times": times, "tokens": tokens, "logprobs": lps}


async def _round(url: str, prompts: list[list[int]], clients: int, new_tokens: int, limit: float) -> dict[str, Any]:
    import httpx

    todo = list(range(len(prompts)))
    results: dict[int, dict[str, Any]] = {}

    async def worker(client: Any) -> None:
        while todo:
            i = todo.pop(0)
            results[i] = await _ask(client, url, prompts[i], new_tokens)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=limit, limits=httpx.Limits(max_connections=clients)) as client:
        tasks = [asyncio.create_task(worker(client)) for _ in range(clients)]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {"wall": time.perf_counter() - t0, "results": results}


def _summary(clients: int, r: dict[str, Any], reference: list[Any], n: int) -> dict[str, Any]:
    ok = {i: x for i, x in r["results"].items() if "error" not in x and x["times"]}
    ttft = [x["times"][0] - x["start"] for x in ok.values()]
    per_token = [(x["times"][-1] - x["times"][0]) / (len(x["times"]) - 1) for x in ok.values() if len(x["times"]) > 1]
    tokens = sum(len(x["tokens"]) for x in ok.values())
    same = sum(x["tokens"] == reference[i].token_ids and x["logprobs"] == reference[i].logprobs for i, x in ok.items())
    return {"clients": clients, "answered": len(ok), "asked": n, "identical": same,
            "tokens_per_s": tokens / r["wall"], "wall_s": r["wall"],
            "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
            "tpot_p50_ms": 1e3 * percentile(per_token, 50), "tpot_p99_ms": 1e3 * percentile(per_token, 99)}


def _start_server(model: str | None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, "-m", "minillama.serve", "--port", "0", "--max-running", "64", "--max-queue", "1024"]
    if model:
        args += ["--model", model]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=env)
    line = p.stderr.readline()
    if "http://" not in line:
        p.kill()
        raise BadInput(f"the server did not start: {line.strip()} {p.stderr.read().strip()}")
    return p, line.split()[-1]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise BadInput(f"--clients must be comma-separated integers, got {args.clients!r}") from None
    if min(levels + [args.questions, args.new_tokens, args.doc_tokens]) < 1:
        raise BadInput("--clients, --questions, --new-tokens and --doc-tokens must be at least 1")
    from .. import api
    from ..bench.task import TaskConfig, make_task, plain_prompt_ids
    from ..cli import _load
    from ..generate import Stats, generate
    import torch

    model = _load(args.model, "cpu", torch.float32)
    task = make_task(model.tokenizer, TaskConfig(args.doc_tokens, 1, args.questions, new_tokens=args.new_tokens),
                     plain_prompt_ids(model.tokenizer))
    params = api.sampling_params(args.new_tokens, ignore_eos=True)
    stats = Stats()
    reference = generate(model.llama, task.prompts, params, mode="parallel", stats=stats)
    cli_tps = stats.generated_tokens / stats.generate_s
    print(f"one parallel generate pass: {len(task.prompts)} questions, {stats.generated_tokens} tokens in "
          f"{stats.generate_s:.2f} s = {cli_tps:.1f} tokens/s", file=sys.stderr)
    del model
    server, url = _start_server(args.model)
    rows = []
    try:
        for c in levels:
            r = asyncio.run(_round(url, task.prompts, c, args.new_tokens, args.time_limit))
            row = _summary(c, r, reference, len(task.prompts))
            row["vs_parallel_pass"] = row["tokens_per_s"] / cli_tps
            rows.append(row)
            print(f"{c:>3} clients: {row['tokens_per_s']:7.1f} tokens/s ({row['vs_parallel_pass']:.2f}x the parallel "
                  f"pass), TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, per token p50 "
                  f"{row['tpot_p50_ms']:.0f} ms p99 {row['tpot_p99_ms']:.0f} ms; {row['identical']}/{row['asked']} "
                  f"answers identical to the parallel pass ({row['answered']} answered)", file=sys.stderr)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    out = {"model": args.model or "default", "doc_tokens": args.doc_tokens, "questions": args.questions,
           "new_tokens": args.new_tokens, "parallel_pass_tokens_per_s": cli_tps, "rounds": rows}
    if args.json:
        write_file(args.json, json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0 if all(r["identical"] == r["asked"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
