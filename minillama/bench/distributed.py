"""The distributed benchmarks: data parallel in whole-process time, tensor parallel's memory and traffic.

    python -m minillama.bench.distributed              # the default model, 2 threads' worth of CPU
    python -m minillama.bench.distributed --quick      # two short documents, tiny shapes: the CI smoke run

- Data parallel: the paper's configuration scaled to 8 documents (a 512-token document each, 64 questions of
  the synthetic task, 8 new tokens, EOS ignored) answered by `minillama generate --input` as one rank of
  `--threads` threads and as `--procs R` ranks of `threads / R` threads each, side by side, repeat after
  repeat; whole-process wall time (model load included: each rank loads it), medians, their ratio, and
  whether the answers' bytes are the same.
- Tensor parallel, at each degree dividing the KV heads: per rank, the parameter bytes (sharded and
  replicated), the KV cache's bytes per token, and the bytes a rank sends per layer per decode step (the
  row-split sums' all-to-all and all-gather, and the LM head's gather), measured on real gloo groups.

Writes distributed.json and prints the tables (docs/distributed.md has a run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import BadInput, OneLineParser, run_command
from ..files import make_dir, write_file
from .task import TaskConfig, make_task, plain_prompt_ids

ROOT = Path(__file__).resolve().parents[2]


def write_jobs(path: Path, tokenizer: Any, config: TaskConfig) -> int:
    """The synthetic task's documents and questions as `generate --input` JSON Lines; returns the question count."""
    task = make_task(tokenizer, config, plain_prompt_ids(tokenizer))
    rows = [{"doc": text, "questions": [q for q, dd in zip(task.questions, task.docs) if dd == d]}
            for d, text in enumerate(task.doc_texts)]
    write_file(path, "".join(json.dumps(r) + "\n" for r in rows))
    return task.n


def data_parallel(model: str | None, jobs: Path, threads: int, ranks: int, new_tokens: int, repeats: int,
                  log=print) -> dict[str, Any]:
    """One rank of `threads` threads against `ranks` ranks of threads // ranks, round-robin, medians."""
    base = [sys.executable, "-m", "minillama", "generate", "--input", str(jobs), "--json", "-n", str(new_tokens),
            "--ignore-eos", *(["--model", model] if model else [])]
    runs = {"one_rank": (base, threads), f"{ranks}_ranks": (base + ["--procs", str(ranks)], max(1, threads // ranks))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    outputs: dict[str, bytes] = {}
    for r in range(repeats):
        for name, (cmd, per_rank) in runs.items():
            env = {**os.environ, "OMP_NUM_THREADS": str(per_rank), "PYTHONPATH": str(ROOT)}
            t0 = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, env=env, cwd=ROOT)
            times[name].append(time.perf_counter() - t0)
            if p.returncode:  # its own one line, as the run's
                raise BadInput(f"{name}: exit {p.returncode}: " + (p.stderr.decode().strip().splitlines() or [""])[-1])
            outputs.setdefault(name, p.stdout)
            log(f"  repeat {r + 1}: {name} {times[name][-1]:.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    one, many = med["one_rank"], med[f"{ranks}_ranks"]
    return {"threads": threads, "ranks": ranks, "threads_per_rank": max(1, threads // ranks), "repeats": repeats,
            "one_rank_s": times["one_rank"], f"{ranks}_ranks_s": times[f"{ranks}_ranks"],
            "median_one_rank_s": one, f"median_{ranks}_ranks_s": many, "speedup": one / many,
            "same_bytes": len(set(outputs.values())) == 1, "answers": outputs["one_rank"].count(b"\n")}


def _tp_rank(local_rank: int, config: Any, tp: int, port: int, out: str) -> None:
    """One rank: a random model at `config`, sharded over tp ranks; measure memory and one decode step's bytes."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(tp),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from ..distributed import tp as tensor_parallel
    from ..distributed.world import finish, init
    from ..generate import SamplingParams, generate
    from .shapes import random_llama

    world = init(tp, torch.device("cpu"), 300)
    model = random_llama(config)
    model.units = config.num_key_value_heads
    whole = _param_bytes(model)
    if tp > 1:
        tensor_parallel.shard_(model, world.tp_group)
    mine = _param_bytes(model)
    cache = model.new_cache(8)
    kv_per_token = cache.bytes_per_token
    comm = model.kernels.comm
    prompts = [[5 + i % 50 for i in range(64)] + [7, 8, 9 + q] for q in range(16)]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    generate(model, prompts, params)  # prefill only
    b0 = comm.bytes_moved
    generate(model, prompts, SamplingParams(max_new_tokens=2, ignore_eos=True))  # prefill + one decode step
    step = comm.bytes_moved - 2 * b0  # the second run's prefill moved what the first one did
    if world.rank == 0:
        write_file(out, json.dumps({
            "tp": tp, "sharded_bytes_one_process": whole["sharded"], "replicated_bytes": whole["replicated"],
            "sharded_bytes_per_rank": mine["sharded"], "replicated_bytes_per_rank": mine["replicated"],
            "param_bytes_per_rank": mine["sharded"] + mine["replicated"],
            "kv_bytes_per_token_per_rank": kv_per_token, "decode_step_questions": len(prompts),
            "bytes_sent_per_decode_step": step, "bytes_sent_per_layer_per_decode_step": step / config.num_hidden_layers}))
    finish()


def _param_bytes(model) -> dict[str, int]:
    """Bytes of the parameters, each storage once (a tied LM head is the embedding's): those tensor parallel
    shards (the projections, the LM head) and those it replicates (embedding, norms)."""
    seen, out = set(), {"sharded": 0, "replicated": 0}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = p.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        kind = "replicated" if ("norm" in name or "embed_tokens" in name) else "sharded"
        out[kind] += p.untyped_storage().nbytes()
    return out


def tensor_parallel_memory(config: Any, degrees: Sequence[int]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    from ..distributed.launch import free_port

    rows = []
    for tp in degrees:
        with tempfile.TemporaryDirectory() as d:
            out = str(Path(d) / "tp.json")
            mp.start_processes(_tp_rank, args=(config, tp, free_port(), out), nprocs=tp, start_method="spawn")
            rows.append(json.loads(Path(out).read_text()))
    return rows


def tables(result: dict[str, Any]) -> str:
    dp, lines = result["data_parallel"], []
    r = dp["ranks"]
    lines += [f"data parallel ({dp['answers']} answers, {dp['repeats']} repeats, whole-process medians):",
              f"  1 rank x {dp['threads']} threads   {dp['median_one_rank_s']:.2f} s",
              f"  {r} ranks x {dp['threads_per_rank']} thread{'s' * (dp['threads_per_rank'] > 1)}    "
              f"{dp[f'median_{r}_ranks_s']:.2f} s   ({dp['speedup']:.2f}x the one rank; same bytes: {dp['same_bytes']})",
              "", "tensor parallel (per rank):",
              "  tp   weights MiB = sharded + replicated   sharded x tp / one process's   KV bytes/token"
              "   sent/layer/decode step"]
    for t in result["tensor_parallel"]:
        lines.append(f"  {t['tp']:<4} {t['param_bytes_per_rank'] / 2**20:9.1f} = {t['sharded_bytes_per_rank'] / 2**20:.1f} + "
                     f"{t['replicated_bytes_per_rank'] / 2**20:.1f}"
                     f"{t['sharded_bytes_per_rank'] * t['tp'] / t['sharded_bytes_one_process']:>25.3f}"
                     f"{t['kv_bytes_per_token_per_rank']:>22}{t['bytes_sent_per_layer_per_decode_step'] / 1024:>19.1f} KiB")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0, 2 bad input (one line), 130 Ctrl-C (`errors.run_command`)."""
    return run_command(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    ap = OneLineParser(prog="python -m minillama.bench.distributed", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two short documents, tiny shapes (CI smoke run)")
    ap.add_argument("-m", "--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2, help="the CPU threads both sides get in all (default: 2)")
    ap.add_argument("--ranks", type=int, default=2, help="data-parallel ranks (default: 2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--docs", type=int, default=8, help="documents (default: 8)")
    ap.add_argument("--questions", type=int, default=64, help="questions per document (default: 64)")
    ap.add_argument("--out", default="bench_results", help="output directory")
    a = ap.parse_args(argv)
    for name in ("threads", "ranks", "repeats", "docs", "questions"):  # each was a traceback, after minutes
        if getattr(a, name) < 1:
            raise BadInput(f"--{name} must be at least 1, got {getattr(a, name)}")
    from ..api import load
    from .shapes import SMOLLM2_SHAPE, TINY_SHAPE

    out = make_dir(a.out)  # an unwritable --out is found now, not after the runs
    a.model = a.model and str(Path(a.model).resolve())  # the runs start in the repository, not here
    tokenizer = load(a.model).tokenizer
    config = TaskConfig(doc_tokens=64 if a.quick else 512, n_docs=2 if a.quick else a.docs,
                        questions_per_doc=2 if a.quick else a.questions, new_tokens=2 if a.quick else 8)
    with tempfile.TemporaryDirectory() as d:
        jobs = Path(d) / "jobs.jsonl"
        write_jobs(jobs, tokenizer, config)
        print(f"data parallel: {config.n_docs} documents x {config.questions_per_doc} questions, "
              f"{config.new_tokens} new tokens")
        dp = data_parallel(a.model, jobs, a.threads, a.ranks, config.new_tokens, a.repeats)
    shape = TINY_SHAPE if a.quick else SMOLLM2_SHAPE
    degrees = [t for t in (1, 2, 3, 4) if shape.num_key_value_heads % t == 0]
    result = {"data_parallel": dp, "tensor_parallel": tensor_parallel_memory(shape, degrees),
              "meta": {"torch": torch.__version__, "cpus": os.cpu_count(), "quick": a.quick}}
    write_file(out / "distributed.json", json.dumps(result, indent=1))
    print(tables(result))
    print(f"wrote {out / 'distributed.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
