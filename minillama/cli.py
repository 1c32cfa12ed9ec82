"""`python -m minillama.generate`: answer many questions about documents from the command line.

    python -m minillama.generate --doc examples/doc.txt --questions examples/questions.txt
    python -m minillama.generate --input jobs.jsonl --json --logprobs > answers.jsonl

A thin shell around `minillama.api`: read and check the input, load the model, `ask_many`, and write
each answer as soon as it and every answer before it (in input order) are finished. Parallel mode runs
the questions of a document in waves sized to a memory budget (`--max-memory`), which changes no answer.
Options follow the names users know from llama.cpp, vLLM and HF `generate`; those of `api.ask_many` come
from the option table (`options.py`), so the flag and the API's keyword refuse a bad value alike.
Exit status: 0 on success; 2 on bad input (one line on stderr, `BadInput`); 130 on Ctrl-C (the answers
written so far stay written); 141 when the reader of stdout goes away; 1 on a bug (a traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

try:
    import resource  # Unix only; elsewhere the summary reports no peak memory
except ImportError:
    resource = None  # type: ignore[assignment]

from . import api
from . import distributed, interrupts, precision, step
from .checks import OPTIONS, RUN_OPTIONS, SAMPLING_OPTIONS, check_options as check_api_options, flag, too_long
from .errors import BadInput, OneLineParser, check_cpu_env, check_device, one_line, run_command, write_whole
from .files import json_text
from .generate import SamplingParams, Stats, StreamTooLong
from .inputs import model_context, read_jobs
from .options import parse_or_keep
from .waves import DEFAULT_MAX_MEMORY_MB, WavePlan, check_max_memory, memory_budget, wave_plan

DTYPES = tuple(precision.DTYPES)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minillama.generate", allow_abbrev=False,
                description="Answer questions about documents; the questions of one document are answered "
                            "together in one packed pass (parallel prompting), each answer bit-identical to "
                            "asking it alone.")
    src = p.add_argument_group("input (--doc and --questions, or --input)")
    src.add_argument("--doc", metavar="DOC", help="the document: a UTF-8 text file (surrounding whitespace "
                     "trimmed); '-' reads standard input")
    src.add_argument("--questions", metavar="QUESTIONS",
                     help="one question per line (surrounding whitespace trimmed, blank lines skipped); "
                          "'-' reads standard input")
    src.add_argument("--input", metavar="FILE.jsonl",
                     help='many documents: one JSON object per line, {"doc": "...", "questions": ["...", ...]}; '
                          "'-' reads standard input")
    add_model_options(p.add_argument_group("model"))
    groups = {"generation": p.add_argument_group("generation"), "prompt": p.add_argument_group("prompt")}
    for name, row in OPTIONS.items():  # api.ask_many's options, each as its row of the table says
        if row.flag is not None:
            default = row.default if row.cli_default is None else row.cli_default
            how = {"action": row.action}
            if row.action in (None, "append"):
                how.update(type=parse_or_keep(row.parse or str), metavar=row.metavar)
            groups[row.group].add_argument(*filter(None, (row.flag, row.short)), dest=name, default=default,
                                           help=row.help, **how)
    groups["generation"].add_argument(
        "--max-memory", type=float, metavar="MB",
        help="memory budget in MiB for the KV cache and per-question activations of parallel mode; the questions "
             f"run in waves that fit (default: {DEFAULT_MAX_MEMORY_MB} on a CPU; on a GPU half its memory less the "
             "model's weights; 0: no bound)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="JSON Lines on stdout, one object per question; the last stderr line is a JSON summary")
    o.add_argument("--logprobs", action="store_true", help="also the log-probability of each generated token")
    distributed.add_options(p)
    return p


def add_model_options(group: Any) -> None:
    """--model, --device, --dtype and --plain-kernels, as every tool that loads a model offers them (generate,
    serve)."""
    group.add_argument("--model", "-m", metavar="PATH", help="HF or Meta directory, or .gguf file (default: the "
                       "default model, SmolLM2-135M-Instruct, converted on first use)")
    group.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    group.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations (default: float32)")
    group.add_argument("--plain-kernels", action="store_true",
                       help="torch's own products and attention instead of the batch-invariant kernels: faster, "
                            "but an answer may depend on what it is batched with (the honest baseline)")
    group.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                       help="on CUDA, run every step eagerly rather than capture each step shape once as a CUDA "
                            "graph and replay it (the same bits either way; graphs are never used on a CPU)")
    group.add_argument("--compile", action="store_true",
                       help="run each step's layers through torch.compile (compiled once per step shape, kept on "
                            "disk): parallel == independent still holds, but compiled answers are not the bits of "
                            "uncompiled ones (docs/gpu.md)")


def sampling(args: argparse.Namespace) -> SamplingParams:
    """The command line's SamplingParams: every field that has a flag, from it (checked by check_options)."""
    return SamplingParams(**{name: getattr(args, name) for name, row in SAMPLING_OPTIONS.items() if row.flag})


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: see `errors.run_command` (0, 2 bad input, 130 Ctrl-C, 141 closed pipe, 1 a bug)."""
    return run_command(lambda: _main(argv))


def _rank(args: argparse.Namespace, jobs: list[tuple[str, list[str]]]) -> int:
    """One rank that --procs started: `answer`, with the exit statuses of `main`."""
    return run_command(lambda: answer(args, jobs))


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_options(args)
    if distributed.launched():  # under torchrun every rank reads the input, and the ranks agree on it (answer)
        return answer(args, None)
    jobs = read_jobs(args, model_context(args.model))
    if args.procs > 1:
        from .distributed import launch

        return launch.run(args, jobs, _rank)
    return answer(args, jobs)


def answer(args: argparse.Namespace, jobs: list[tuple[str, list[str]]] | None) -> int:
    """Load the model and answer every question; in a distributed run, this rank's part of that. `jobs`
    None: read them here (every rank under torchrun)."""
    import torch

    from .distributed import parallel
    from .distributed.dp import input_key
    from .distributed.parallel import piece_job

    t0 = time.perf_counter()
    here = parallel.join(args)  # one process, or this rank of torchrun's (--procs') world

    def prepare() -> tuple[list[tuple[str, list[str]]], api.LoadedModel]:
        """Everything that may refuse the input, before any rank shares work (a tensor-parallel rank reads
        only its parts of the checkpoint, on the host, and `place` moves them to the device)."""
        read = jobs if jobs is not None else read_jobs(args, model_context(args.model))
        loaded = load_checkpoint(args.model, parallel.load_device(args, here), getattr(torch, args.dtype),
                                 parallel.sharding(args, here), invariant=not args.plain_kernels,
                                 cuda_graphs=args.cuda_graphs, compiled=args.compile)
        why = too_long(loaded.tokenizer, read, loaded.context_length)  # before tokenizing anything
        if why is not None:
            raise BadInput(why)
        api.template_parts(loaded.tokenizer, args.system, args.chat_template)  # it renders, writing the text
        return read, loaded

    jobs, model = here.agree(prepare, same=lambda done: input_key(done[0]))
    parallel.place(model.llama, args, here)
    load_s = time.perf_counter() - t0
    n_questions = sum(len(q) for _, q in jobs)
    shares, mine = parallel.shares(jobs, here, model.tokenizer, args.max_new_tokens, args.mode), here.world.dp_rank
    share, budget = shares[mine], memory_budget(args.max_memory, model.llama)
    plans = [plan_waves(model, [piece_job(jobs, p) for p in s], args, budget) if s else WavePlan(None, None, 0)
             for i, s in enumerate(shares) if i == mine or here.world.writes]  # rank 0 (group 0's): every group's
    plan, most = plans[0], max(p.bytes for p in plans)  # this rank's, and the largest of any (rank 0 warns of it)
    if budget and most > budget and here.world.writes:
        warn_over_budget(model, jobs, args, most, budget)

    out = sys.stdout  # written in UTF-8 whatever its encoding (errors.write_whole)
    stats = Stats()
    progress = Progress(n_questions * args.max_new_tokens, sys.stderr if here.world.writes else None)
    writer = AnswerWriter(out, args, len(jobs), n_questions, model.context_length, progress)
    channel = here.channel(jobs, share, writer)
    try:
        _ask(model, jobs, share, args, plan, progress, stats, channel)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank; the one that writes says what it wrote
        progress.close()
        return interrupted(channel, writer, out, n_questions if here.world.writes else None)
    except Exception as e:  # rank 0 must hear of another rank's error before that rank ends
        here.failed(e)
        raise
    finally:
        progress.close()
    totals = here.finish(channel, stats)
    if not here.world.writes:
        return 0

    n_most = max(len(q) for _, q in jobs)
    summary = {"load_s": round(load_s, 3), "generate_s": round(totals.generate_s, 3),
               "prefill_s": round(totals.prefill_s, 3), "decode_s": round(totals.decode_s, 3),
               "prompt_tokens": totals.prompt_tokens, "generated_tokens": totals.generated_tokens,
               "tokens_per_s": round(totals.generated_tokens / totals.generate_s, 2) if totals.generate_s else 0.0,
               "forward_passes": totals.forward_passes, "peak_kv_mb": round(stats.peak_kv_bytes / 2**20, 2),
               "peak_memory_mb": round(peak_rss_mb(), 1), "documents": len(jobs), "questions": n_questions,
               "mode": args.mode, "device": args.device, "dtype": args.dtype,
               "products": precision.describe(args.device, getattr(torch, args.dtype)),
               "parallel_size": min(plan.parallel_size or n_most, n_most),  # a wave holds what there is
               "batch_docs": min(plan.batch_docs or len(jobs), len(jobs)),
               "max_memory_mb": _mib(budget), "planned_memory_mb": _mib(most), **here.summary()}
    print(json_text(summary) if args.json else summary_line(summary), file=sys.stderr)
    return 0


def _ask(model, jobs, share, args, plan, progress, stats, channel) -> None:
    from .distributed.parallel import piece_job

    if not share:  # a rank past the last piece: nothing to do
        return
    run = {name: getattr(args, name) for name, row in RUN_OPTIONS.items() if row.flag}
    run.update(parallel_size=plan.parallel_size, batch_docs=plan.batch_docs)
    try:
        api.ask_many(model, [piece_job(jobs, p) for p in share], sampling(args), **run, on_token=progress.update,
                     stats=stats, on_reply=channel.on_reply, first_question=channel.first_question)
    except api.PromptTooLong as e:  # numbered within this rank's share: say which input question it is
        def renumber(m: re.Match) -> str:
            d, lo, _ = share[int(m[1]) - 1]
            return f"document {d + 1}, question {lo + int(m[2])}"
        raise BadInput(re.sub(r"^document (\d+), question (\d+)", renumber, str(e))) from None
    except StreamTooLong as e:
        raise BadInput(f"{e}; use --mode parallel or fewer questions per document") from None


# --- input ----------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    """Every option value, checked before anything slow happens."""
    if args.input is not None and (args.doc is not None or args.questions is not None):
        raise BadInput("--input replaces --doc and --questions; give one or the other")
    if args.input is None and (args.doc is None or args.questions is None):
        raise BadInput("give --doc DOC and --questions QUESTIONS, or --input FILE.jsonl")
    if args.doc == "-" and args.questions == "-":
        raise BadInput("--doc and --questions cannot both read standard input")
    check_max_memory(args.max_memory)
    if args.max_memory is not None and args.mode != "parallel":
        raise BadInput(f"--max-memory sizes parallel mode's waves; --mode {args.mode} holds one question at a time: "
                       "drop --max-memory")
    # the API's own checks, from the option table, naming the options as the command line spells them
    check_api_options(spell=flag, **{name: getattr(args, name) for name, row in OPTIONS.items() if row.flag})
    check_device(args.device)
    check_cpu_env()
    if args.compile and (args.tp > 1 or args.procs > 1 or distributed.launched()):
        raise BadInput("--compile runs in one process (a tensor-parallel rank's steps run eagerly); drop it or --tp, "
                       "--procs and torchrun")
    distributed.check_options(args)
    if args.procs > 1:
        from .distributed.launch import check_procs

        check_procs(args)


def load_checkpoint(path: str | None, device: str, dtype: Any, shard=None, invariant: bool = True,
                    cuda_graphs: bool = True, compiled: bool = False) -> api.LoadedModel:
    """The model of --model. shard: a tensor-parallel rank's (distributed.parallel.sharding): only its parts
    are read; `invariant=False` (--plain-kernels) switches the batch-invariant kernels off; `cuda_graphs=False`
    (--no-cuda-graphs) runs every step eagerly; `compiled` (--compile) runs the steps' layers through
    torch.compile (step.py)."""
    from .tokenizer import TokenizerError
    from .weights import WeightsError, load_model

    if path and not os.path.lexists(path):  # a loop, a dangling link or "": the loader names it
        raise BadInput(f"--model {path}: no such file or directory")
    if compiled and not invariant:
        raise BadInput(step.PLAIN_COMPILED)
    try:
        if shard is not None:
            model = api.LoadedModel(*load_model(path, device=device, dtype=dtype, shard=shard))
        else:
            model = api.load(path, device=device, dtype=dtype)
        model.llama.invariant = invariant
        if not cuda_graphs:
            model.llama.steps.captured = False
        model.llama.steps.compiled = compiled
        if compiled:
            step.check_compiler(model.llama.device)
        return model
    except (WeightsError, TokenizerError, OSError) as e:  # OSError: unreadable files
        raise BadInput(one_line(f"--model {'(default)' if path is None else repr(str(path))}: {e}")) from None


# --- output ---------------------------------------------------------------------------------------


def reply_json(r: api.Reply, logprobs: bool) -> dict[str, Any]:
    d = {"question": r.question, "answer": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
         "prompt_token_ids": r.prompt_token_ids, "doc_index": r.doc_index, "question_index": r.question_index}
    if logprobs:
        d["logprobs"] = r.logprobs  # Python floats: json writes repr, which round-trips exactly
    return d


def interrupted(channel: Any, writer: "AnswerWriter", out: TextIO, n_questions: int | None) -> int:
    """After Ctrl-C: what is written is flushed and, where this rank writes (`n_questions` given), counted on
    stderr; exit 130. The receiving thread's answer in progress is written and counted first, no other follows
    (AnswerWriter keeps write and count together); a thread stuck writing (a pipe nobody reads) is not waited out."""
    channel.lock.acquire(timeout=5)
    with contextlib.suppress(OSError, ValueError):  # an answer Ctrl-C caught before its flush is written
        out.flush()
    if n_questions is not None:
        print(f"interrupted: {writer.written} of {n_questions} answers written", file=sys.stderr)
    return 130


class AnswerWriter:
    """`ask_many`'s on_reply: writes each answer (a text block or a JSON line) and flushes, in input order,
    as soon as it and every answer before it are finished; a later answer that finishes first waits for
    the earlier ones. Also warns, once, when the context cut an answer short of --max-new-tokens."""

    def __init__(self, out: TextIO, args: argparse.Namespace, n_docs: int, n_questions: int, context: int,
                 progress: "Progress"):
        self.out, self.args, self.n_docs, self.context, self.progress = out, args, n_docs, context, progress
        self.n_questions, self.written = n_questions, 0
        self.waiting: dict[int, api.Reply] = {}
        self.warned = self.warned_nan = False

    def __call__(self, i: int, reply: api.Reply) -> None:
        self._warn_if_cut_short(reply)
        self.waiting[i] = reply
        if self.written not in self.waiting:
            return
        self.progress.clear()
        while self.written in self.waiting:
            with interrupts.together():  # a Ctrl-C between an answer's write and its count made them disagree
                write_whole(self.out, self._text(self.waiting.pop(self.written)),
                            f"{self.written} of {self.n_questions} answers written")
                self.written += 1

    def _text(self, r: api.Reply) -> str:
        if not self.warned_nan and not all(math.isfinite(x) for x in r.logprobs):
            self.warned_nan = True
            print(f"warning: document {r.doc_index + 1}, question {r.question_index + 1}: the model's logits "
                  f"are not finite (NaN or inf: {precision.why_not_finite(precision.DTYPES[self.args.dtype])}), so "
                  "its answers mean nothing" + ("; such log-probs are written as null" if self.args.json else "")
                  + "; this warning is shown once", file=sys.stderr, flush=True)
        if self.args.json:
            return json_text(reply_json(r, self.args.logprobs), ensure_ascii=False) + "\n"
        head = f"=== document {r.doc_index + 1} ===\n\n" if self.n_docs > 1 and r.question_index == 0 else ""
        tail = (f"   ({len(r.token_ids)} tokens, {r.finish_reason}, sum of logprobs {sum(r.logprobs):.4f})\n"
                if self.args.logprobs else "")
        return f"{head}Q: {r.question}\nA: {r.text.strip()}\n{tail}\n"

    def _warn_if_cut_short(self, r: api.Reply) -> None:
        n = self.args.max_new_tokens
        if self.warned or r.finish_reason != "length" or len(r.token_ids) >= n:
            return
        self.warned = True
        self.progress.clear()
        what = ("seqbatch's stream before this answer (the document, every question and answer before it, its "
                f"question) has {self.context + 1 - len(r.token_ids)}"  # + 1: an answer's last token is never run
                if self.args.mode == "seqbatch" else f"the prompt has {len(r.prompt_token_ids)}")
        print(f"warning: document {r.doc_index + 1}, question {r.question_index + 1}: {what} tokens, so the model's "
              f"context ({self.context}) left room for {len(r.token_ids)} of the {n} new tokens asked for "
              "(finish_reason \"length\"); this warning is shown once", file=sys.stderr, flush=True)


# --- memory: parallel mode in waves -----------------------------------------------------------------


def plan_waves(model: api.LoadedModel, jobs: Sequence[tuple[str, Sequence[str]]], args: argparse.Namespace,
               budget_bytes: int) -> WavePlan:
    """`wave_plan` for parallel mode, from token counts: each document and question tokenized alone, plus
    the template's text around them (the same for every prompt). Other modes hold one question at a time."""
    if args.mode != "parallel":
        return WavePlan(args.parallel_size, args.batch_docs, 0)
    tok, config = model.tokenizer, model.llama.config
    head, middle, tail = api.template_parts(tok, args.system, args.chat_template)
    around_doc = len(tok.encode(head + middle, parse_special=False))
    after_question = len(tok.encode(tail, parse_special=False)) + 2  # + tokens merged across a boundary
    doc_tokens = [len(tok.encode(doc, parse_special=False)) + around_doc for doc, _ in jobs]
    question_tokens = [[len(tok.encode(q, parse_special=False)) + after_question for q in qs] for _, qs in jobs]
    dtype_bytes = next(model.llama.parameters()).element_size()
    llama = model.llama  # a compiled pass holds its attention items at once, up to the tiles' bound (model.py)
    held = llama.tiles.attention.at_once if llama.steps.compiled else 0
    return wave_plan(config, dtype_bytes, doc_tokens, question_tokens, args.max_new_tokens,
                     budget_bytes, args.parallel_size, args.batch_docs, held)


def warn_over_budget(model: api.LoadedModel, jobs: list, args: argparse.Namespace, most: int, budget: int) -> None:
    """Warn that the waves need `most` bytes, past the budget; not where a prompt is past the context, whose
    refusal (ask_many's, after this) is then the one line: tokenized here first, only when a warning is due."""
    try:
        api.build_prompts(model.tokenizer, jobs, args.system, args.chat_template, model.context_length)
    except api.PromptTooLong:
        return
    given = " and ".join(f"--{name.replace('_', '-')} {n}" for name in ("parallel_size", "batch_docs")
                         if (n := getattr(args, name)) is not None)  # the user's own sizes, or the least there is
    waves = f"the waves {given} ask for" if given else "the smallest waves (one question of one document a pass)"
    limit = f"--max-memory {args.max_memory:g}" if args.max_memory is not None else \
        f"the budget --max-memory left unset gives ({budget / 2**20:g} MiB)"
    print(f"warning: {waves} are estimated at {most / 2**20:.1f} MiB, more than {limit}; running them",
          file=sys.stderr, flush=True)


def _mib(n: int) -> float:
    """Bytes in MiB, to 2 places, or 3 figures below 0.01 MiB (a budget of a byte once read 0: "no bound")."""
    return round(n / 2**20, 2) if n == 0 or n >= 2**20 / 100 else float(f"{n / 2**20:.3g}")


def _count(n: int, noun: str) -> str:
    """'1 question', '5 questions'."""
    return f"{n} {noun}{'s' * (n != 1)}"


def summary_line(s: dict[str, Any]) -> str:
    return (f"{_count(s['documents'], 'document')}, {_count(s['questions'], 'question')}, mode {s['mode']}: "
            f"{s['prompt_tokens']} prompt tokens, "
            f"{s['generated_tokens']} generated in {s['generate_s']:.2f} s ({s['tokens_per_s']:.1f} tokens/s); "
            f"load {s['load_s']:.2f} s; peak memory {s['peak_memory_mb']:.0f} MB" +
            (f"; waves of {_count(s['parallel_size'], 'question')}, {_count(s['batch_docs'], 'document')} per pass "
             f"(planned {s['planned_memory_mb']:.0f} MiB" +
             (f" of --max-memory {s['max_memory_mb']:g})" if s["max_memory_mb"] else "; --max-memory 0: no bound)")
             if s["mode"] == "parallel" else ""))


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    if resource is None:
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


class Progress:
    """A one-line progress bar on a terminal; silent when the stream is not one (logs, pipes, tests).
    The total is an upper bound (every answer at --max-new-tokens); answers that stop early end it sooner."""

    def __init__(self, total: int, stream: TextIO, width: int = 30):
        self.total, self.stream, self.width = max(total, 1), stream, width
        self.enabled = hasattr(stream, "isatty") and stream.isatty()
        self.done, self.t0, self.last = 0, time.perf_counter(), 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if not self.enabled or now - self.last < 0.1:
            return
        self.last = now
        filled = min(self.width, self.width * self.done // self.total)
        rate = self.done / (now - self.t0) if now > self.t0 else 0.0
        self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done} tokens, "
                          f"{rate:.1f} tokens/s ")
        self.stream.flush()

    def clear(self) -> None:
        """Take the bar off its line, so that an answer or a message can be written there; the next
        update draws it again."""
        if self.enabled and self.last:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.last = 0.0

    def close(self) -> None:
        self.clear()  # the summary takes the bar's line
