"""`python -m minillama.generate`: answer many questions about documents from the command line.

    python -m minillama.generate --doc examples/doc.txt --questions examples/questions.txt
    python -m minillama.generate --input jobs.jsonl --json --logprobs > answers.jsonl

A thin shell around `minillama.api`: read and check the input, load the model, `ask_many`, print.
Options follow the names users know from llama.cpp, vLLM and HF `generate`.
Exit status: 0 on success; 2 on bad input (one line on stderr, nothing on stdout); 1 on a bug.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from . import api
from .errors import BadInput, OneLineParser
from .generate import MODES, Stats

DTYPES = ("float32", "bfloat16", "float16")


_Parser = OneLineParser  # the name the oracle's command line imported first


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
    m = p.add_argument_group("model")
    m.add_argument("--model", "-m", metavar="PATH", help="HF or Meta directory, or .gguf file (default: the "
                   "default model, SmolLM2-135M-Instruct, converted on first use)")
    m.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    m.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations (default: float32)")
    g = p.add_argument_group("generation")
    g.add_argument("--mode", default="parallel", choices=MODES,
                   help="parallel (default): one document, all its questions packed; independent: each "
                        "question alone; seqbatch: one stream, question after answer after question")
    g.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N",
                   help="most tokens per answer (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default)")
    g.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K likeliest tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling, in (0, 1] (1: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop an answer at this string (repeatable); the answer is cut before it")
    g.add_argument("--parallel-size", type=int, metavar="P",
                   help="most questions of one document decoded together (default: all)")
    g.add_argument("--batch-docs", type=int, metavar="N", help="documents per forward pass (default: all)")
    pr = p.add_argument_group("prompt")
    pr.add_argument("--system", metavar="TEXT", help="system prompt (default: the chat template's own)")
    pr.add_argument("--no-chat-template", action="store_true",
                    help=f"plain prompt instead of the chat template: {api.PLAIN_TEMPLATE!r}")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="JSON Lines on stdout, one object per question; the last stderr line is a JSON summary")
    o.add_argument("--logprobs", action="store_true", help="also the log-probability of each generated token")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_options(args)
    jobs = read_jobs(args)
    n_questions = sum(len(q) for _, q in jobs)

    import torch

    t0 = time.perf_counter()
    model = _load(args.model, args.device, getattr(torch, args.dtype))
    load_s = time.perf_counter() - t0

    stats = Stats()
    progress = Progress(n_questions * args.max_new_tokens, sys.stderr)
    try:
        replies = api.ask_many(
            model, jobs, mode=args.mode, system=args.system, chat_template=not args.no_chat_template,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop,
            parallel_size=args.parallel_size, batch_docs=args.batch_docs, on_token=progress.update,
            stats=stats)
    except ValueError as e:  # a prompt longer than the context, a seqbatch stream that outgrows it, ...
        raise BadInput(str(e)) from None
    finally:
        progress.close()

    out = sys.stdout
    if getattr(out, "encoding", "utf-8").lower().replace("-", "") != "utf8" and hasattr(out, "reconfigure"):
        out.reconfigure(encoding="utf-8")  # JSON Lines are UTF-8, and so is any answer the model writes
    if args.json:
        for doc_replies in replies:
            for r in doc_replies:
                out.write(json.dumps(reply_json(r, args.logprobs), ensure_ascii=False) + "\n")
    else:
        write_text(out, replies, args.logprobs)
    out.flush()

    summary = {"load_s": round(load_s, 3), "generate_s": round(stats.generate_s, 3),
               "prefill_s": round(stats.prefill_s, 3), "decode_s": round(stats.decode_s, 3),
               "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
               "tokens_per_s": round(stats.generated_tokens / stats.generate_s, 2) if stats.generate_s else 0.0,
               "forward_passes": stats.forward_passes, "peak_kv_mb": round(stats.peak_kv_bytes / 2**20, 2),
               "peak_memory_mb": round(peak_rss_mb(), 1), "documents": len(jobs), "questions": n_questions,
               "mode": args.mode, "device": args.device, "dtype": args.dtype}
    print(json.dumps(summary) if args.json else summary_line(summary), file=sys.stderr)
    return 0


# --- input ----------------------------------------------------------------------------------------


def check_options(args: argparse.Namespace) -> None:
    """Every option value, checked before anything slow happens."""
    if args.input is not None and (args.doc is not None or args.questions is not None):
        raise BadInput("--input replaces --doc and --questions; give one or the other")
    if args.input is None and (args.doc is None or args.questions is None):
        raise BadInput("give --doc DOC and --questions QUESTIONS, or --input FILE.jsonl")
    if args.doc == "-" and args.questions == "-":
        raise BadInput("--doc and --questions cannot both read standard input")
    for name in ("parallel_size", "batch_docs"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise BadInput(f"--{name.replace('_', '-')} must be at least 1, got {v}")
    if math.isnan(args.temperature):  # SamplingParams says so too; name the option here
        raise BadInput("--temperature must be a finite number >= 0, got nan")
    try:
        api.sampling_params(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                            args.ignore_eos)
    except ValueError as e:
        raise BadInput(str(e).replace("max_new_tokens", "--max-new-tokens").replace("top_k", "--top-k")
                       .replace("top_p", "--top-p").replace("temperature", "--temperature")) from None
    if any(not s for s in args.stop):
        raise BadInput("--stop must not be empty")
    _check_device(args.device)


def _check_device(device: str) -> None:
    import torch

    try:
        torch.empty(1, device=torch.device(device))
    except (RuntimeError, AssertionError, ValueError) as e:
        raise BadInput(f"--device {device}: not usable here ({str(e).splitlines()[0]})") from None


def read_text(path: str, what: str) -> str:
    """A UTF-8 text file (or standard input for '-'), whole. A leading byte-order mark is dropped."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{what} {path}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{what} {path}: is a directory, not a file") from None
    except OSError as e:
        raise BadInput(f"{what} {path}: cannot read ({e.strerror or e})") from None
    if b"\0" in data:
        raise BadInput(f"{what} {path}: a binary file, not UTF-8 text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{what} {path}: not UTF-8 text (invalid byte at offset {e.start})") from None


def read_jobs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(document, questions) pairs from --doc/--questions or --input."""
    if args.input is None:
        doc = read_text(args.doc, "--doc")
        if not doc.strip():
            raise BadInput(f"--doc {args.doc}: the document is empty")
        questions = [q.strip() for q in read_text(args.questions, "--questions").splitlines() if q.strip()]
        if not questions:
            raise BadInput(f"--questions {args.questions}: no questions (one per line)")
        return [(doc, questions)]
    jobs = []
    for n, line in enumerate(read_text(args.input, "--input").splitlines(), 1):
        if not line.strip():
            continue
        where = f"--input {args.input}, line {n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise BadInput(f"{where}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise BadInput(f'{where}: expected an object {{"doc": ..., "questions": [...]}}')
        extra = sorted(set(obj) - {"doc", "questions"})
        if extra:
            raise BadInput(f"{where}: unknown key {extra[0]!r} (expected doc and questions)")
        doc, questions = obj.get("doc"), obj.get("questions")
        if not isinstance(doc, str) or not doc.strip():
            raise BadInput(f'{where}: "doc" must be a non-empty string')
        if not isinstance(questions, list) or not questions:
            raise BadInput(f'{where}: "questions" must be a non-empty list of strings')
        for k, q in enumerate(questions):
            if not isinstance(q, str) or not q.strip():
                raise BadInput(f'{where}: question {k + 1} must be a non-empty string')
        jobs.append((doc, questions))
    if not jobs:
        raise BadInput(f"--input {args.input}: no documents")
    return jobs


def _load(path: str | None, device: str, dtype: Any) -> api.LoadedModel:
    from .tokenizer import TokenizerError
    from .weights import WeightsError

    if path is not None and not Path(path).exists():
        raise BadInput(f"--model {path}: no such file or directory")
    try:
        return api.load(path, device=device, dtype=dtype)
    except (WeightsError, TokenizerError) as e:
        raise BadInput(_one_line(f"--model {path or '(default)'}: {e}")) from None
    except (OSError, ValueError) as e:  # unreadable files, a config minillama does not support
        raise BadInput(_one_line(f"--model {path or '(default)'}: {e}")) from None


def _one_line(s: str) -> str:
    return " ".join(s.split())


# --- output ---------------------------------------------------------------------------------------


def reply_json(r: api.Reply, logprobs: bool) -> dict[str, Any]:
    d = {"question": r.question, "answer": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
         "prompt_token_ids": r.prompt_token_ids, "doc_index": r.doc_index, "question_index": r.question_index}
    if logprobs:
        d["logprobs"] = r.logprobs  # Python floats: json writes repr, which round-trips exactly
    return d


def write_text(out: TextIO, replies: list[list[api.Reply]], logprobs: bool) -> None:
    for d, doc_replies in enumerate(replies):
        if len(replies) > 1:
            out.write(f"=== document {d + 1} ===\n\n")
        for r in doc_replies:
            out.write(f"Q: {r.question}\nA: {r.text.strip()}\n")
            if logprobs:
                out.write(f"   ({len(r.token_ids)} tokens, {r.finish_reason}, "
                          f"sum of logprobs {sum(r.logprobs):.4f})\n")
            out.write("\n")


def summary_line(s: dict[str, Any]) -> str:
    docs = f"{s['documents']} document{'s' * (s['documents'] != 1)}"
    questions = f"{s['questions']} question{'s' * (s['questions'] != 1)}"
    return (f"{docs}, {questions}, mode {s['mode']}: {s['prompt_tokens']} prompt tokens, "
            f"{s['generated_tokens']} generated in {s['generate_s']:.2f} s ({s['tokens_per_s']:.1f} tokens/s); "
            f"load {s['load_s']:.2f} s; peak memory {s['peak_memory_mb']:.0f} MB")


def peak_rss_mb() -> float:
    """This process's peak resident memory (ru_maxrss is in KiB on Linux, bytes on macOS)."""
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

    def close(self) -> None:
        if self.enabled and self.last:
            self.stream.write("\r\033[K")  # clear the bar: the summary takes its line
            self.stream.flush()
