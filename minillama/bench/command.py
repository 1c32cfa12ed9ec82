"""The command: `python -m minillama.bench` (or `minillama bench`)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..distributed.launch import usable_cpus
from ..errors import BadInput, OneLineParser, check_device, run_command
from ..files import json_text, make_dir, write_file
from .llamacpp import available as llamacpp_available
from .methods import METHODS
from .presets import MANY_QUESTIONS, preset
from .profile import _profile_main
from .report import findings, headline_table, many_table, readme_text, target_rows, write_outputs
from .runner import Case, run, setup
from .shapes import SHAPES, TINY_SHAPE

DESCRIPTION = "Benchmarks: parallel prompting against the ways people answer many questions about one document."
SWEEPS = ("headline", "answer16", "docs", "doclen", "grid", "questions", "many")
MAX_PROFILE_QUESTIONS = 4096  # a bound on the questions --profile writes out before it runs


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status (`errors.run_command`): 0 done, 2 bad options or an unwritable --out (one line), 130
    Ctrl-C; a bug is a traceback. `--threads` holds for this call only: torch's thread count is put back."""
    threads = torch.get_num_threads()
    try:
        return run_command(lambda: _main(argv))
    finally:
        torch.set_num_threads(threads)


def _positive(what: str, v: int | None, least: int = 1) -> None:
    if v is not None and v < least:
        raise BadInput(f"{what} must be at least {least}, got {v}")


def _names(option: str, value: str, known: Sequence[str], noun: str) -> set[str]:
    names = {x.strip() for x in value.split(",") if x.strip()}
    unknown = sorted(names - set(known))
    if unknown or not names:
        what = f"unknown {noun}(s) {', '.join(unknown)}" if unknown else f"no {noun} named"
        raise BadInput(f"{option}: {what} (known: {', '.join(known)})")
    return names


def _counts(option: str, value: str) -> set[int]:
    try:
        counts = {int(x) for x in value.split(",") if x.strip()}
    except ValueError:
        raise BadInput(f"{option}: expected comma-separated integers, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise BadInput(f"{option}: expected positive integers, got {value!r}")
    return counts


def _check_threads(threads: int | None) -> None:
    """--threads within the CPUs this process may use: past them threads only take turns (and torch's
    OpenMP runtime ends the process at 100,000 and overflows at 2**31)."""
    _positive("--threads", threads)
    cpus = usable_cpus()
    if threads is not None and threads > cpus:
        raise BadInput(f"--threads {threads}: more than the {cpus} CPUs this process may use "
                       f"(at most --threads {cpus})")


def _check_tp(a: argparse.Namespace) -> None:
    """--tp as `minillama generate` checks it: at least 1, and above 1 only for --shape, in a world torchrun
    started of a multiple of --tp ranks, --tp dividing the shape's KV heads."""
    from ..distributed import check_degrees, check_world_env

    _positive("--tp", a.tp)
    if a.tp == 1:
        return
    if not a.shape:
        raise BadInput(f"--tp {a.tp}: only the shape bench (--shape) runs tensor parallel; drop --tp")
    world = check_world_env()
    if world % a.tp:
        raise BadInput(f"--tp {a.tp} needs a multiple of {a.tp} ranks, got {world}"
                       + (f"; start them with torchrun --nproc-per-node {a.tp}" if world == 1 else ""))
    check_degrees(SHAPES[a.shape].num_key_value_heads, a.tp, None, world)


def _check_combination(a: argparse.Namespace) -> None:
    """Options given empty, or that the bench they were given to would not read: BadInput naming the first,
    rather than a run that silently ignores it (an empty --out wrote into the current directory)."""
    for option in ("--out", "--model", "--methods", "--only", "--doc-lengths", "--questions", "--from-json",
                   "--readme"):
        value = getattr(a, option[2:].replace("-", "_"))
        if value is not None and not value.strip():
            raise BadInput(f"{option} is empty: give a value or leave the option out")
    shape_only = [o for o, given in (("--tables", a.tables), ("--compare-dtypes", a.compare_dtypes),
                                     ("--parity", a.parity), ("--compiled", a.compiled), ("--tiny", a.tiny),
                                     ("--dtype", a.dtype != "float32"), ("--device", a.device != "cpu")) if given]
    task_only = [o for o, given in (("--quick", a.quick), ("--full", a.full), ("--model", a.model),
                                    ("--only", a.only), ("--methods", a.methods), ("--doc-lengths", a.doc_lengths),
                                    ("--questions", a.questions), ("--profile", a.profile),
                                    ("--no-llamacpp", a.no_llamacpp)) if given]
    run_only = [o for o, given in (("--repeats", a.repeats is not None), ("--sample", a.sample is not None),
                                   ("--threads", a.threads is not None), ("--no-hf", a.no_hf)) if given]
    if a.from_json and (a.shape or shape_only or task_only or run_only):
        first = "--shape" if a.shape else (shape_only + task_only + run_only)[0]
        raise BadInput(f"--from-json renders a saved run and runs nothing: drop {first}")
    if a.shape and task_only:
        raise BadInput(f"{task_only[0]} is the task bench's, and --shape runs the shape bench: drop one")
    if not a.shape and shape_only:
        raise BadInput(f"{shape_only[0]} is the shape bench's (with --shape): drop it, or add --shape")
    profile_only = [o for o in ("--doc-tokens", "--profile-questions", "--new-tokens")
                    if getattr(a, o[2:].replace("-", "_")) is not None]
    if profile_only and not a.profile:  # read by --profile alone: a shape or task run passed over them
        raise BadInput(f"{profile_only[0]} is --profile's: drop it, or add --profile")
    if a.profile and (a.only or a.methods or a.doc_lengths or a.questions):
        raise BadInput("--profile runs its own configuration (--doc-tokens, --profile-questions, --new-tokens): "
                       "drop --only, --methods, --doc-lengths and --questions")


def _read_results(path: str) -> dict:
    """A results.json written by an earlier run, checked enough that rendering it cannot fail."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadInput(f"--from-json {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--from-json {path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    except (ValueError, RecursionError) as e:
        raise BadInput(f"--from-json {path}: not JSON ({e})") from None
    if not (isinstance(data, dict) and isinstance(data.get("records"), list) and isinstance(data.get("meta"), dict)
            and all(isinstance(r, dict) for r in data["records"])):
        raise BadInput(f"--from-json {path}: not a bench results.json (an object with meta and records)")
    return data


def _main(argv: Sequence[str] | None) -> int:
    ap = OneLineParser(prog="python -m minillama.bench", description=DESCRIPTION)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny random model, seconds (CI smoke test)")
    g.add_argument("--full", action="store_true", help="no sampling, 3 repeats (long)")
    ap.add_argument("-m", "--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random", nargs="?", const="smollm2", choices=sorted(SHAPES), metavar="SHAPE",
                    help="random weights at a named shape (default: smollm2, the default model's), the task's "
                         "token ids with no tokenizer; llama.cpp runs an F32 GGUF of the same weights "
                         f"({', '.join(sorted(SHAPES))})")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers methods")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp method")
    ap.add_argument("--methods", help="comma-separated methods to keep in every case "
                    f"({','.join(METHODS)})")
    ap.add_argument("--only", help=f"comma-separated sweeps to run ({','.join(SWEEPS)})")
    ap.add_argument("--doc-lengths", help="comma-separated document lengths to keep in the doclen sweep (512,...,4096)")
    ap.add_argument("--questions", help="comma-separated question counts to keep in the many sweep "
                    f"({','.join(map(str, MANY_QUESTIONS))})")
    ap.add_argument("--repeats", type=int, help="repeats per method (medians are reported)")
    ap.add_argument("--sample", type=int, help="questions run by the sampled methods in the headline case "
                    "(0: every question; --shape's default: 4)")
    ap.add_argument("--threads", type=int, help="torch threads, at most the CPUs this process may use (default: "
                    "torch's choice)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of benchmarking: profile parallel and independent at the paper's configuration "
                         "(--doc-tokens to change the document) and write profile.md")
    ap.add_argument("--doc-tokens", type=int, help="document length for --profile (default: 512)")
    ap.add_argument("--profile-questions", type=int, help="questions for --profile (default: 64; --quick: 8)")
    ap.add_argument("--new-tokens", type=int, help="new tokens per question for --profile (default: 8)")
    ap.add_argument("--out", default="bench_results", help="output directory")
    d = ap.add_argument_group("random weights at a named shape, on any device, against its roofline (no checkpoint)")
    d.add_argument("--shape", choices=sorted(SHAPES), help="run this benchmark instead of the task one")
    d.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="default: float32")
    d.add_argument("--tables", action="store_true", help="also the paper's Table 3 and Table 4 configurations")
    d.add_argument("--compare-dtypes", action="store_true", help="also the headline's parallel in float32, bfloat16 "
                   "and float16 side by side, with the path each dtype's products took")
    d.add_argument("--parity", action="store_true", help="first check parallel against independent, every step's "
                   "logits bit for bit, with the invariant and the plain kernels (bench/parity.py)")
    d.add_argument("--compiled", action="store_true", help="also parallel with each step's layers through "
                   "torch.compile (parallel_compiled; the first compiled run, timed apart, holds the compiles), and, "
                   "with --parity, its parity")
    d.add_argument("--tiny", action="store_true", help="every size divided down: seconds on a CPU (tests)")
    d.add_argument("--tp", type=int, default=1, help="tensor parallel over this many ranks (start them with torchrun "
                   "--nproc-per-node N); minillama's methods only (default: 1)")
    ap.add_argument("--from-json", metavar="RESULTS", help="rewrite tables and plots from a results.json, run nothing")
    ap.add_argument("--readme", metavar="README", help="with --from-json: regenerate the performance table between "
                    "the README's bench-table markers")
    a = ap.parse_args(argv)
    if a.readme and not a.from_json:
        ap.error("--readme needs --from-json RESULTS (the table is rendered from a saved run)")
    _check_combination(a)
    _check_threads(a.threads)
    _positive("--repeats", a.repeats)
    _positive("--sample", a.sample, 0)
    _positive("--doc-tokens", a.doc_tokens)
    _positive("--profile-questions", a.profile_questions)
    if (a.profile_questions or 0) > MAX_PROFILE_QUESTIONS:  # each one is written out before the run (1e20: never)
        raise BadInput(f"--profile-questions must be at most {MAX_PROFILE_QUESTIONS:,}, got {a.profile_questions}")
    _positive("--new-tokens", a.new_tokens)
    a.doc_tokens, a.new_tokens = a.doc_tokens or 512, a.new_tokens or 8  # --profile's defaults
    a.profile_questions = a.profile_questions or (8 if a.quick else 64)
    if a.random and a.shape:
        raise BadInput(f"--shape {a.shape} runs the shape bench, --random {a.random} the task bench: choose one")
    if a.random and (a.quick or a.model):
        raise BadInput(f"--random {a.random}: random weights replace {'--quick' if a.quick else '--model'}'s; drop one")
    counts = _counts("--questions", a.questions) if a.questions else None
    only = _names("--only", a.only, SWEEPS, "sweep") if a.only else None
    methods = _names("--methods", a.methods, METHODS, "method") if a.methods else None
    _check_tp(a)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {a.device}: no CUDA device here")
    check_device(a.device)
    data = _read_results(a.from_json) if a.from_json else None  # before --out is made: a bad file leaves nothing
    out = make_dir(a.out)  # an unwritable --out is found now, not after the run
    if a.shape:
        return _shape_main(a, list(sys.argv[1:] if argv is None else argv))
    if data is not None:  # everything is rendered before anything is written
        readme = None
        if a.readme:
            try:
                readme = readme_text(Path(a.readme), data)
            except (OSError, ValueError, KeyError, TypeError, ArithmeticError, StopIteration) as e:
                raise BadInput(f"--readme {a.readme}: {str(e) or repr(e)}") from None
        try:
            paths = write_outputs(out, data["records"], data["meta"])
        except (KeyError, TypeError, ValueError, ArithmeticError, StopIteration) as e:
            lacks = f"no {e.args[0]!r}" if isinstance(e, KeyError) and e.args else repr(e)
            raise BadInput(f"--from-json {a.from_json}: the results lack what the tables need ({lacks})") from None
        if readme is not None:
            write_file(a.readme, readme[1])
            print(f"{a.readme}: performance table {'updated' if readme[1] != readme[0] else 'already up to date'}")
        print(headline_table(data["records"]) + "\n")
        print("\n".join(f"{t}: {v} ({m})" for t, v, m in target_rows(findings(data["records"]))))
        print("wrote", ", ".join(str(p) for p in paths))
        return 0

    name = "quick" if a.quick else "full" if a.full else "default"
    # The tiny model's ops last microseconds: a second thread only adds synchronisation (10x slower on a
    # busy 2-core machine). The real model uses every core torch sees.
    threads = a.threads or (1 if a.quick else None)
    if threads:
        torch.set_num_threads(threads)
    hf = not a.no_hf
    if hf:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            print("transformers is not installed: skipping the hf_* methods", file=sys.stderr)
            hf = False
    llamacpp = not a.no_llamacpp
    if llamacpp and not llamacpp_available():
        print("llama-cpp-python is not installed: skipping the llamacpp method", file=sys.stderr)
        llamacpp = False
    cases, repeats = preset(name, hf, llamacpp)
    if only:
        cases = [c for c in cases if c.sweep in only]
    if a.doc_lengths:
        cases = _keep(cases, "doclen", lambda c: c.task.doc_tokens, _counts("--doc-lengths", a.doc_lengths),
                      f"--doc-lengths {a.doc_lengths}", name)
    if counts:
        cases = _keep(cases, "many", lambda c: c.task.questions_per_doc, counts, f"--questions {a.questions}", name)
    if methods:
        for c in cases:
            c.methods = tuple(m for m in c.methods if m in methods)
        cases = [c for c in cases if c.methods]
    if not cases:
        raise BadInput("no case left to run: --only, --methods, --doc-lengths and --questions together exclude "
                       "every case")
    if a.repeats:
        repeats = a.repeats
    if a.sample is not None:
        for c in cases:
            if c.sweep == "headline":
                c.sample = a.sample or None
    t0 = time.perf_counter()
    shape = TINY_SHAPE if a.quick else SHAPES[a.random] if a.random else None
    scratch = tempfile.TemporaryDirectory(prefix="minillama-bench-")  # HF copies of random weights
    ctx = setup(a.model, shape, hf, Path(scratch.name))
    model_name = ("random tiny" if a.quick else f"random {a.random} shape" if a.random
                  else a.model or "SmolLM2-135M-Instruct")
    if a.profile:
        return _profile_main(ctx, out, a.doc_tokens, a.profile_questions, model_name,
                             a.new_tokens)
    print(f"minillama bench, preset {name}: {len(cases)} cases, {repeats} repeats, model {model_name} "
          f"(setup {time.perf_counter() - t0:.1f} s)", flush=True)
    records, gemm = run(cases, ctx, repeats, log=lambda s: print(s, flush=True))
    c = ctx.model.config
    meta = {"preset": name, "model": model_name, "commit": _commit(), "threads": torch.get_num_threads(), "repeats": repeats,
            "gemm_gflops": statistics.median(gemm), "gemm_gflops_all": gemm, "torch": torch.__version__,
            "gemm_shape": [2048, c.hidden_size, c.intermediate_size],
            "run_s": time.perf_counter() - t0, "command": " ".join(["python -m minillama.bench", *(sys.argv[1:] if argv is None else argv)])}
    paths = write_outputs(out, records, meta)
    table = headline_table(records)  # empty when no headline case ran (--only doclen)
    print("\n" + table + "\n" if table else "")
    if any(r["sweep"] == "many" for r in records):
        print(many_table(records) + "\n")
    if a.quick:
        print("(a tiny random model: the targets are about the default model; these lines only show the harness works)")
    for t, v, m in target_rows(findings(records)):
        print(f"{t}: {v} ({m})")
    print(f"\nwrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.md'}, "
          + ", ".join(str(p) for p in paths) + f" in {time.perf_counter() - t0:.0f} s")
    return 0


def _keep(cases: list[Case], sweep: str, size: Callable[[Case], int], kept: set[int], option: str,
          preset_name: str) -> list[Case]:
    """The cases, those of `sweep` only at the sizes `kept`; BadInput when the sweep ran and none is kept
    (the sizes of another preset: the sweep would vanish without a word)."""
    sizes = sorted({size(c) for c in cases if c.sweep == sweep})
    if sizes and not kept & set(sizes):
        raise BadInput(f"{option}: the {sweep} sweep of preset {preset_name} runs {', '.join(map(str, sizes))}; "
                       "none of them is kept")
    return [c for c in cases if c.sweep != sweep or size(c) in kept]


def _commit() -> str:
    """The checked-out commit, with "+dirty" when minillama/ (the bench package aside) has uncommitted changes."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "minillama",
                                ":!minillama/bench"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _shape_main(a: argparse.Namespace, argv: list[str]) -> int:
    """--shape: random weights on --device in --dtype; results.json-like output under --out."""
    import importlib.util

    from .device import dtype_table, shape_main, table
    from .parity import parity_table

    if a.compare_dtypes and a.tp > 1:
        raise BadInput("--compare-dtypes runs in one process; drop --tp")
    if a.parity and a.tp > 1:
        raise BadInput("--parity runs in one process; drop --tp")
    if a.compiled and a.tp > 1:
        raise BadInput("--compiled: a tensor-parallel rank's steps run eagerly; drop --tp")
    if a.threads:
        torch.set_num_threads(a.threads)
    hf = not a.no_hf and importlib.util.find_spec("transformers") is not None
    sample = 4 if a.sample is None else a.sample  # 0: every question
    data = shape_main(a.shape, a.device, a.dtype, a.tiny, a.tables, a.repeats or 3, sample, hf,
                      log=lambda s: print(s, flush=True), tp=a.tp, dtypes=a.compare_dtypes, parity_check=a.parity,
                      compiled=a.compiled)
    if data is None:  # a tensor-parallel rank other than 0: rank 0 reports
        return 0
    data["meta"]["command"] = " ".join(["python -m minillama.bench", *argv])  # the bench's own (not "bench")
    out = Path(a.out)
    write_file(out / "shape_results.json", json_text(data, indent=1) + "\n")
    m = data["meta"]
    head = (f"random {m['shape']} weights, {m['device_name']}, {m['dtype']} ({m['products']}), torch {m['torch']}; GEMM "
            f"{m['gemm_tflops']:.2f} TFLOP/s, copy bandwidth {m['bandwidth_gbs']:.0f} GB/s; medians of "
            f"{data['records'][0]['repeats']} repeats" + ("; independent ran on a sample of the questions, its time "
                                                          "scaled" if any(r["scaled_by"] != 1 for r in data["records"]) else ""))
    if "compiled_first_run_s" in m:
        head += f"; the first compiled run (its compiles) took {m['compiled_first_run_s']:.1f} s"
    body = table(data["records"]) + (f"\n\n{dtype_table(data['dtypes'])}" if data["dtypes"] else "")
    if data["parity"]:
        body = f"{parity_table(data['parity'])}\n\n{body}"
    write_file(out / "shape_summary.md", f"# {head}\n\n{body}\n")
    print(f"\n{head}\n\n{body}\n\nwrote {out / 'shape_results.json'}, {out / 'shape_summary.md'}")
    return 0

