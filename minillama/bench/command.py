"""The command: `python -m minillama.bench` (or `minillama bench`)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from . import __doc__ as _package_doc
from .llamacpp import available as llamacpp_available
from .methods import METHODS
from .presets import preset
from .profile import _profile_main
from .report import findings, headline_table, target_rows, update_readme, write_outputs
from .runner import run, setup
from .shapes import SHAPES, SMOLLM2_SHAPE, TINY_SHAPE

DESCRIPTION = (_package_doc or "").split("\n")[0]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillama.bench", description=DESCRIPTION)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="tiny random model, seconds (CI smoke test)")
    g.add_argument("--full", action="store_true", help="no sampling, 3 repeats (long)")
    ap.add_argument("-m", "--model", help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--random", action="store_true", help="random weights with the default model's shape")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers methods")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip the llama.cpp method")
    ap.add_argument("--methods", help="comma-separated methods to keep in every case "
                    f"({','.join(METHODS)})")
    ap.add_argument("--only", help="comma-separated sweeps to run (headline,docs,doclen,grid,questions)")
    ap.add_argument("--doc-lengths", help="comma-separated document lengths to keep in the doclen sweep (512,...,4096)")
    ap.add_argument("--repeats", type=int, help="repeats per method (medians are reported)")
    ap.add_argument("--sample", type=int, help="questions run by the sampled methods in the headline case")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of benchmarking: profile parallel and independent at the paper's configuration "
                         "(--doc-tokens to change the document) and write profile.md")
    ap.add_argument("--doc-tokens", type=int, default=512, help="document length for --profile")
    ap.add_argument("--out", default="bench_results", help="output directory")
    d = ap.add_argument_group("random weights at a named shape, on any device, against its roofline (no checkpoint)")
    d.add_argument("--shape", choices=sorted(SHAPES), help="run this benchmark instead of the task one")
    d.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    d.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="default: float32")
    d.add_argument("--tables", action="store_true", help="also the paper's Table 3 and Table 4 configurations")
    d.add_argument("--compare-dtypes", action="store_true", help="also the headline's parallel in float32, bfloat16 "
                   "and float16 side by side, with the path each dtype's products took")
    d.add_argument("--tiny", action="store_true", help="every size divided down: seconds on a CPU (tests)")
    d.add_argument("--tp", type=int, default=1, help="tensor parallel over this many ranks (start them with torchrun "
                   "--nproc-per-node N); minillama's methods only (default: 1)")
    ap.add_argument("--from-json", metavar="RESULTS", help="rewrite tables and plots from a results.json, run nothing")
    ap.add_argument("--readme", metavar="README", help="with --from-json: regenerate the performance table between "
                    "the README's bench-table markers")
    a = ap.parse_args(argv)
    if a.readme and not a.from_json:
        ap.error("--readme needs --from-json RESULTS (the table is rendered from a saved run)")
    if a.shape:
        return _shape_main(a)
    if a.from_json:
        data = json.loads(Path(a.from_json).read_text())
        if a.readme:
            try:
                changed = update_readme(Path(a.readme), data)
            except (OSError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"{a.readme}: performance table {'updated' if changed else 'already up to date'}")
        paths = write_outputs(Path(a.out), data["records"], data["meta"])
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
    if a.only:
        keep = set(a.only.split(","))
        cases = [c for c in cases if c.sweep in keep]
    if a.doc_lengths:
        try:
            lengths = {int(x) for x in a.doc_lengths.split(",")}
        except ValueError:
            print(f"error: --doc-lengths: expected comma-separated integers, got {a.doc_lengths!r}", file=sys.stderr)
            return 2
        cases = [c for c in cases if c.sweep != "doclen" or c.task.doc_tokens in lengths]
    if a.methods:
        keep = set(a.methods.split(","))
        unknown = keep - set(METHODS)
        if unknown:
            print(f"error: --methods: unknown method(s) {', '.join(sorted(unknown))} (known: {', '.join(METHODS)})",
                  file=sys.stderr)
            return 2
        for c in cases:
            c.methods = tuple(m for m in c.methods if m in keep)
        cases = [c for c in cases if c.methods]
    if a.repeats:
        repeats = a.repeats
    if a.sample is not None:
        for c in cases:
            if c.sweep == "headline":
                c.sample = a.sample or None
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    shape = TINY_SHAPE if a.quick else SMOLLM2_SHAPE if a.random else None
    scratch = tempfile.TemporaryDirectory(prefix="minillama-bench-")  # HF copies of random weights
    ctx = setup(a.model, shape, hf, Path(scratch.name))
    model_name = "random " + ("tiny" if a.quick else "SmolLM2-135M shape") if shape else (a.model or "SmolLM2-135M-Instruct")
    if a.profile:
        return _profile_main(ctx, out, a.doc_tokens, 8 if a.quick else 64, model_name)
    print(f"minillama bench, preset {name}: {len(cases)} cases, {repeats} repeats, model {model_name} "
          f"(setup {time.perf_counter() - t0:.1f} s)", flush=True)
    records, gemm = run(cases, ctx, repeats, log=lambda s: print(s, flush=True))
    meta = {"preset": name, "model": model_name, "commit": _commit(), "threads": torch.get_num_threads(), "repeats": repeats,
            "gemm_gflops": statistics.median(gemm), "gemm_gflops_all": gemm, "torch": torch.__version__,
            "run_s": time.perf_counter() - t0, "command": " ".join(["python -m minillama.bench", *(argv or sys.argv[1:])])}
    paths = write_outputs(out, records, meta)
    table = headline_table(records)  # empty when no headline case ran (--only doclen)
    print("\n" + table + "\n" if table else "")
    if a.quick:
        print("(a tiny random model: the targets are about the default model; these lines only show the harness works)")
    for t, v, m in target_rows(findings(records)):
        print(f"{t}: {v} ({m})")
    print(f"\nwrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'summary.md'}, "
          + ", ".join(str(p) for p in paths) + f" in {time.perf_counter() - t0:.0f} s")
    return 0


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


def _shape_main(a: argparse.Namespace) -> int:
    """--shape: random weights on --device in --dtype; results.json-like output under --out."""
    import importlib.util

    from .device import dtype_table, shape_main, table

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {a.device}: no CUDA device here", file=sys.stderr)
        return 2
    if a.compare_dtypes and a.tp > 1:
        print("error: --compare-dtypes runs in one process; drop --tp", file=sys.stderr)
        return 2
    if a.threads:
        torch.set_num_threads(a.threads)
    hf = not a.no_hf and importlib.util.find_spec("transformers") is not None
    data = shape_main(a.shape, a.device, a.dtype, a.tiny, a.tables, a.repeats or 3, a.sample or 4, hf,
                      log=lambda s: print(s, flush=True), tp=a.tp, dtypes=a.compare_dtypes)
    if data is None:  # a tensor-parallel rank other than 0: rank 0 reports
        return 0
    data["meta"]["command"] = " ".join(["python -m minillama.bench", *sys.argv[1:]])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shape_results.json").write_text(json.dumps(data, indent=1) + "\n")
    m = data["meta"]
    head = (f"random {m['shape']} weights, {m['device_name']}, {m['dtype']} ({m['products']}), torch {m['torch']}; GEMM "
            f"{m['gemm_tflops']:.2f} TFLOP/s, copy bandwidth {m['bandwidth_gbs']:.0f} GB/s; medians of "
            f"{data['records'][0]['repeats']} repeats; independent ran on a sample of the questions, its time scaled")
    body = table(data["records"]) + (f"\n\n{dtype_table(data['dtypes'])}" if data["dtypes"] else "")
    (out / "shape_summary.md").write_text(f"# {head}\n\n{body}\n")
    print(f"\n{head}\n\n{body}\n\nwrote {out / 'shape_results.json'}, {out / 'shape_summary.md'}")
    return 0

