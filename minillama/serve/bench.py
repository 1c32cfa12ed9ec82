"""`python -m minillama.serve.bench`: `minillama serve` and llama.cpp's server under 1, 8, 32, 64 concurrent
clients asking about one document, against one parallel pass of `generate` on the same questions; then a
long randomized run of the bit-identity promise.

    python -m minillama.serve.bench --model PATH [--doc-tokens 512] [--questions 64] [--new-tokens 16]

The questions are the benchmark's synthetic task (bench/task.py): one document, questions about its facts,
each answered greedily with `--new-tokens` tokens (EOS ignored). In order:

1. one parallel `generate` pass over every question, in this process, timed three times (the median is the
   throughput reference): the answers every served answer must equal (parallel prompting makes them each question's solo run);
2. a fresh `minillama serve` process (servers.py): one round at the largest client count while nothing is
   cached (the document is computed during the round, as in the parallel pass), then one round per client
   count with the document's blocks cached, as a server that keeps them would answer;
3. the same rounds against a fresh llama-cpp-python server (`llama_cpp.server`) on an F32 GGUF of the same
   weights (bench/gguf_f32.py), given the same prompts as text (each checked to tokenize to the same ids).
   It answers one request at a time: llama-cpp-python's server holds one llama.cpp sequence and a lock
   around it, so concurrent clients queue there; it reuses the previous prompt's keys and values for the
   part a new prompt shares with it (the document). Skipped, with a note, if llama_cpp is not installed;
4. the randomized identity run (identity.py): `--identity-requests` random requests from concurrent
   clients, every choice compared with its solo run.

Per round (loadgen.py): throughput, time to first token and time per later token (p50, p99). Every round
is bounded by `--time-limit` seconds and each server's start-up by `--start-limit`; the servers are
stopped (their whole process groups) however the bench ends. Exit 0 when every served minillama answer
equals the parallel pass's and every choice of the randomized run equals its solo run; 1 otherwise; 2 on
bad input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from ..files import write_file
from ..errors import BadInput, OneLineParser, run_command
from .loadgen import body_for, run_round, summary


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillama.serve.bench", allow_abbrev=False,
                      description="minillama serve and llama.cpp's server under concurrent clients, against one "
                                  "parallel generate pass; then a randomized bit-identity run")
    p.add_argument("--model", "-m", metavar="PATH", help="checkpoint (default: the default model)")
    p.add_argument("--doc-tokens", type=int, default=512, help="document length in tokens (default: 512)")
    p.add_argument("--questions", type=int, default=64, help="questions about the document (default: 64)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per answer, EOS ignored (default: 16)")
    p.add_argument("--clients", default="1,8,32,64", help="concurrent client counts (default: 1,8,32,64)")
    p.add_argument("--time-limit", type=float, default=600.0, metavar="S", help="most seconds per round (default: 600)")
    p.add_argument("--start-limit", type=float, default=600.0, metavar="S",
                   help="most seconds for a server to start (default: 600)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's server out")
    p.add_argument("--identity-requests", type=int, default=300, metavar="N",
                   help="requests in the randomized identity run (default: 300; 0: none)")
    p.add_argument("--identity-clients", type=int, default=32, metavar="N",
                   help="concurrent clients in the randomized identity run (default: 32)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: see `errors.run_command` (0, 2 bad input, 130 Ctrl-C (the servers stopped on the way out), 141 closed pipe, 1 a bug)."""
    return run_command(lambda: _main(argv))


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rounds(url: str, dialect: str, prompts: list[Any], levels: list[int], new_tokens: int,
            limit: float) -> list[dict[str, Any]]:
    """A round at the largest client count on the fresh server (nothing cached), then one per level."""
    bodies = [body_for(dialect, p, new_tokens) for p in prompts]
    plan = [(max(levels), False)] + [(c, True) for c in levels]
    rows = []
    for clients, cached in plan:
        r = run_round(url, bodies, clients, limit)
        row = {"clients": clients, "cached": cached, **summary(r, len(bodies), new_tokens), "_results": r["results"]}
        _say(f"  {dialect}: {clients:>3} clients, document {'cached' if cached else 'not cached'}: "
             f"{row['tokens_per_s']:.2f} tokens/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, per token p50 "
             f"{row['tpot_p50_ms']:.0f} ms; {row['answered']}/{row['asked']} answered")
        rows.append(row)
    return rows


def _warm(url: str, dialect: str, prompt: Any) -> None:
    """One short unrelated request first: the servers' first-call set-up is not part of any round."""
    run_round(url, [body_for(dialect, prompt, 2)], 1, 600.0)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        levels = [int(c) for c in args.clients.split(",")]
    except ValueError:
        raise BadInput(f"--clients must be comma-separated integers, got {args.clients!r}") from None
    if min(levels + [args.questions, args.new_tokens, args.doc_tokens, args.identity_clients]) < 1:
        raise BadInput("--clients, --questions, --new-tokens, --doc-tokens and --identity-clients must be at least 1")
    if args.identity_requests < 0:
        raise BadInput(f"--identity-requests must be >= 0, got {args.identity_requests}")
    for name in ("time_limit", "start_limit"):
        if not getattr(args, name) > 0:
            raise BadInput(f"--{name.replace('_', '-')} must be a positive number of seconds")
    import torch

    from .. import api
    from ..bench.task import TaskConfig, check_fits, make_task, plain_prompt_ids
    from ..cli import load_checkpoint
    from ..generate import Stats, generate
    from ..bench.gguf_f32 import vocabulary_source
    from . import identity
    from .servers import llamacpp_available, minillama_server

    if args.json and not Path(args.json).resolve().parent.is_dir():  # before the run, not after it
        raise BadInput(f"--json {args.json}: the folder {Path(args.json).resolve().parent} does not exist")
    model = load_checkpoint(args.model, "cpu", torch.float32)
    tok = model.tokenizer
    task = make_task(tok, TaskConfig(args.doc_tokens, 1, args.questions, new_tokens=args.new_tokens),
                     plain_prompt_ids(tok))
    check_fits(task, args.new_tokens, model.context_length, f"--doc-tokens {args.doc_tokens}")
    warm_ids = tok.encode("Hello, how are you?")
    generate(model.llama, [warm_ids], api.sampling_params(2))  # first-call set-up, outside the timed pass
    passes = []  # the pass is timed three times (the median is the reference); its answers are the same each time
    for _ in range(3):
        stats = Stats()
        reference = generate(model.llama, task.prompts, api.sampling_params(args.new_tokens, ignore_eos=True),
                             mode="parallel", stats=stats)
        passes.append(stats.generate_s)
    pass_s = statistics.median(passes)
    cli_tps = stats.generated_tokens / pass_s
    _say(f"one parallel generate pass: {len(task.prompts)} questions, {stats.generated_tokens} tokens in "
         f"{pass_s:.2f} s (median of {', '.join(f'{t:.2f}' for t in passes)}) = {cli_tps:.2f} tokens/s")
    del model
    out: dict[str, Any] = {"model": args.model or "default", "doc_tokens": args.doc_tokens,
                           "prompt_tokens": len(task.prompts[0]), "questions": args.questions,
                           "new_tokens": args.new_tokens, "torch_threads": torch.get_num_threads(),
                           "parallel_pass_tokens_per_s": cli_tps, "parallel_pass_s": passes}

    with minillama_server(args.model, max(levels)) as (url, pid):
        out["server_pids"] = [pid]
        _warm(url, "minillama", warm_ids)
        mini = _rounds(url, "minillama", task.prompts, levels, args.new_tokens, args.time_limit)
    for row in mini:
        res = row.pop("_results")
        row["identical"] = sum("error" not in x and x["tokens"] == reference[i].token_ids
                               and x["logprobs"] == reference[i].logprobs for i, x in res.items())
        row["vs_parallel_pass"] = row["tokens_per_s"] / cli_tps
    out["minillama"] = mini

    texts = vocabulary_source(args.model) is not None  # llama.cpp's F32 GGUF of it can tokenize the rounds' text
    if args.no_llama_cpp or not llamacpp_available() or not texts:
        out["llama_cpp"] = None
        _say("llama.cpp's server: left out" + ("" if args.no_llama_cpp else
             " (its F32 GGUF of this checkpoint has no vocabulary, and the rounds send text: give --model a "
             ".gguf)" if not texts else " (llama_cpp is not installed: pip install 'llama-cpp-python[server]==0.3.36')"))
    else:
        out["llama_cpp"] = _llamacpp(args, task, tok, reference, levels)
        out["server_pids"].append(out["llama_cpp"].pop("pid"))
        for m, lc in zip(mini, out["llama_cpp"]["rounds"]):
            m["vs_llama_cpp"] = {k: m[k] / lc[k] if lc[k] else float("nan")
                                 for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}

    if args.identity_requests:
        _say(f"randomized identity run: {args.identity_requests} requests from {args.identity_clients} clients")
        ident = identity.run(tok, task.prompts, task.questions, args.identity_requests, args.identity_clients)
        _say(f"  {ident['identical']}/{ident['choices']} choices identical to their solo runs "
             f"({ident['stop_string_cuts']} cut by a stop string, {ident['echoed']} echoed, "
             f"{ident['prefix_hit_tokens']} prompt tokens found cached, {ident['evicted_blocks']} blocks evicted)")
        if ident["first_mismatch"]:
            _say(ident["first_mismatch"])
        out["identity"] = ident
    _say(table(out))
    print(json.dumps(out), flush=True)  # first: a file that cannot be written loses nothing
    if args.json:
        write_file(args.json, json.dumps(out, indent=1) + "\n")
    ok = all(r["identical"] == r["asked"] for r in mini)
    ident = out.get("identity")
    return 0 if ok and (ident is None or ident["identical"] == ident["choices"]) else 1


def _llamacpp(args: argparse.Namespace, task: Any, tok: Any, reference: list[Any], levels: list[int]) -> dict[str, Any]:
    """The same rounds against llama-cpp-python's server on the F32 GGUF of the same weights."""
    import torch

    from ..bench.gguf_f32 import f32_gguf
    from .servers import llamacpp_server

    gguf = f32_gguf(args.model)
    texts = [tok.decode(p) for p in task.prompts]
    n_ctx = max(len(p) for p in task.prompts) + args.new_tokens + 64
    threads = torch.get_num_threads()
    with llamacpp_server(gguf, n_ctx, threads) as (url, pid):
        import httpx

        same_ids = sum(httpx.post(url[:-3] + "/extras/tokenize", json={"input": t}, timeout=60).json()["tokens"] == p
                       for t, p in zip(texts, task.prompts))
        _warm(url, "llama_cpp", "Hello, how are you?")
        rows = _rounds(url, "llama_cpp", texts, levels, args.new_tokens, args.time_limit)
    for row in rows:
        res = row.pop("_results")
        row["same_text_as_minillama"] = sum("error" not in x and x["text"] == tok.decode(reference[i].token_ids)
                                            for i, x in res.items())
    _say(f"  llama.cpp tokenized {same_ids}/{len(texts)} prompts to the same ids as minillama")
    return {"pid": pid, "gguf": str(gguf), "n_ctx": n_ctx, "threads": threads, "prompts_tokenized_alike": same_ids,
            "rounds": rows}


def _ms(x: float) -> str:
    return f"{x / 1e3:.2f} s" if x >= 1e3 else f"{x:.0f} ms"


def table(out: dict[str, Any]) -> str:
    """The results as a Markdown table: minillama serve's numbers, its ratios to the parallel pass and to
    llama.cpp's server (throughput: higher is better for minillama; latencies: lower is)."""
    lc = out.get("llama_cpp")
    head = ["round", "tokens/s", "vs parallel pass", "TTFT p50 / p99", "per token p50 / p99", "identical"]
    if lc:
        head += ["llama.cpp tokens/s", "throughput vs llama.cpp", "TTFT p50 / p99 vs llama.cpp",
                 "per token p50 / p99 vs llama.cpp"]
    lines = ["| " + " | ".join(head) + " |", "|" + " ---: |" * len(head)]
    for k, m in enumerate(out["minillama"]):
        name = f"{m['clients']} client{'s' if m['clients'] > 1 else ''}{'' if m['cached'] else ', not cached'}"
        cells = [name, f"{m['tokens_per_s']:.2f}",
                 f"{m['vs_parallel_pass']:.2f}x", f"{_ms(m['ttft_p50_ms'])} / {_ms(m['ttft_p99_ms'])}",
                 f"{_ms(m['tpot_p50_ms'])} / {_ms(m['tpot_p99_ms'])}", f"{m['identical']}/{m['asked']}"]
        if lc:
            r, v = lc["rounds"][k], m["vs_llama_cpp"]
            cells += [f"{r['tokens_per_s']:.2f}", f"{v['tokens_per_s']:.2f}x",
                      f"{v['ttft_p50_ms']:.2f}x / {v['ttft_p99_ms']:.2f}x",
                      f"{v['tpot_p50_ms']:.2f}x / {v['tpot_p99_ms']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
