"""Every check a GPU needs, in one run that fits a short loan of the machine, written to one JSON.

    python -m minillama.bench.gpu_check                    # on the GPU machine, from a clone
    python -m minillama.bench.gpu_check --quick --device cpu   # the same steps, tiny, on a CPU (tests)

In order, each step recorded whatever the others do:

0. `ahead`: decoding one step ahead of the host (generate._decode, on by default on a GPU) against the host in
   step, on a tiny random model: the same answers, greedy and sampled. Where it fails, the rest of the check
   runs with the host in step (`ahead_fallback` in the JSON, and said in the log), so that one fault of that
   path does not cost the loan's other figures; the test run (6.) still shows it;
1. `parity` (bench/parity.py) at SmolLM2's shape in float32 and Llama-3-8B's in bfloat16: parallel against
   independent, every step's logits, invariant and plain kernels, and captured steps against eager ones;
   with `--compiled`, the same with compiled steps (step.py);
2. the shape bench (bench/device.py) at both shapes: parallel (captured steps), parallel with plain kernels,
   parallel with eager steps, independent on a sample, HF batched `generate` and the roofline floor, one run
   (with `--compiled`, parallel with compiled steps too, compiled from cold in a fresh cache directory, and
   at SmolLM2's shape a second process's first compiled run on that directory: bench/warm.py), and
   parallel at the units `minillama generate` takes by default (the KV heads; the others take 1), with the
   parity check there too;
3. the targets the GPU work is measured by, as ratios from that one run;
4. at Llama-3-8B's shape: `parallel` with each candidate set of GPU tiles (`_candidates`), side by
   side in round-robin repeats, and a profile of one `parallel` run (the ops that take the device's and the
   host's time), to tune `invariant.CUDA_TILES` from one loan of the machine (with `--compiled`, a profile
   of one compiled run too); and where a run's wall time goes on the host (`host_split`: laying out,
   waiting for the device, the rest), ahead of the device and in step, there and at SmolLM2's shape, where
   `minillama serve`'s engine (no HTTP) answers the same questions one pass ahead and in step, timed;
   at both shapes, `row_probe`: which of the device's products give a row the whole tile's bits with fewer
   rows (or items) beside it, and what each row count costs (for the record: the model proves for itself);
5. `serve`: `minillama serve` over HTTP on the device (serve/identity.py): random requests from concurrent
   clients, every choice against its solo run, with the invariant kernels and the plain ones (the control);
   skipped where starlette or uvicorn is not installed;
6. the CUDA test run, last, in the time the loan has left (`--budget`): the device tests
   (`MINILLAMA_TEST_DEVICE`) as a subprocess, pass/fail counts and the failures' lines.

The JSON (default docs/bench/gpu/<device>-check.json) holds the device's name, torch's version, the commit,
and each step's results and seconds. docs/gpu.md says how to read it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence
from unittest import mock

import torch

from .. import step as step_module
from ..errors import BadInput, check_device, run_command
from ..files import json_text, make_dir, write_file
from ..oracle.record import git_commit
from ..serve import identity
from . import row_probe, warm

ROOT = Path(__file__).resolve().parents[2]
DEVICE_TESTS = ["tests/test_parity.py", "tests/test_attention.py", "tests/test_model.py", "tests/test_cache.py",
                "tests/test_generate.py", "tests/test_invariant.py", "tests/test_signatures.py",
                "tests/test_family.py", "tests/test_step.py", "tests/test_compile.py"]
# (shape, dtype) of the parity checks and the bench.
CASES = (("smollm2", "float32"), ("llama3-8b", "bfloat16"))


def source_digest(root: Path = ROOT) -> str:
    """SHA-256 over the package's Python sources (path and bytes of each, in path order)."""
    h = hashlib.sha256()
    for path in sorted((root / "minillama").rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def run_tests(device: str, timeout_s: float, files: Sequence[str] = DEVICE_TESTS, workers: int = 0) -> dict[str, Any]:
    """The device tests in a subprocess; its summary line's counts and failures. `workers` > 0: that many
    pytest-xdist processes (where it is installed). At `timeout_s` the run is interrupted (SIGINT) so that
    pytest still reports what failed so far."""
    env = {**os.environ, "MINILLAMA_TEST_DEVICE": device}
    spread = ["-n", str(workers)] if workers and importlib.util.find_spec("xdist") else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=line", "-p", "no:cacheprovider", *spread, *files]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        timed_out = True
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", out)}
    failed = [line for line in out.splitlines() if line.startswith("FAILED") or line.startswith("ERROR")]
    return {"command": " ".join(cmd), "exit": proc.returncode, "timed_out": timed_out, **counts,
            "failures": failed[:80], "tail": out[-6000:]}


def targets(bench: dict[str, Any]) -> dict[str, Any]:
    """The GPU work's targets, from one bench run: ratios of medians of the headline case."""
    by = {r["method"]: r for r in bench["records"] if r["label"] == "headline"}
    out: dict[str, Any] = {}
    if "parallel" in by and "parallel_plain" in by:
        out["exact_over_plain"] = by["parallel"]["wall_s"] / by["parallel_plain"]["wall_s"]
    if "parallel" in by:
        out["parallel_over_floor"] = by["parallel"]["x_floor"]
    if "parallel" in by and "hf_batched" in by:
        out["hf_over_parallel"] = by["hf_batched"]["wall_s"] / by["parallel"]["wall_s"]
    if "parallel" in by and "parallel_eager" in by:
        out["eager_over_captured"] = by["parallel_eager"]["wall_s"] / by["parallel"]["wall_s"]
    if "parallel" in by and "parallel_in_step" in by:
        out["in_step_over_ahead"] = by["parallel_in_step"]["wall_s"] / by["parallel"]["wall_s"]
    if "parallel" in by and "parallel_units" in by:
        out["units_over_one"] = by["parallel_units"]["wall_s"] / by["parallel"]["wall_s"]
    if "parallel" in by and "parallel_compiled" in by:
        out["compiled_over_parallel"] = by["parallel_compiled"]["wall_s"] / by["parallel"]["wall_s"]
        out["compiled_first_run_s"] = bench["meta"].get("compiled_first_run_s")
        out["compiled_warm_first_run_s"] = bench["meta"].get("compiled_warm", {}).get("first_run_s")
    return out


def check(device: str, quick: bool, out: Path, test_timeout_s: float, budget_s: float = 0.0,
          log=print, compiled: bool = False) -> dict[str, Any]:
    make_dir(out.parent)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else device
    commit = git_commit() or os.environ.get("MINILLAMA_COMMIT", "")  # no .git there: the caller names it
    # The code that ran, whatever a copy's (stale) git metadata says: `source_digest()` of a checkout tells.
    result: dict[str, Any] = {"device_name": name, "device": device, "torch": torch.__version__, "commit": commit,
                              "source_sha256": source_digest(), "quick": quick, "compiled": compiled, "steps": {}}
    # A fresh cache directory (the environment is restored after): the first compiled run compiles cold.
    fresh = {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="minillama-inductor-")} if compiled else {}
    with mock.patch.dict(os.environ, fresh), mock.patch.object(step_module, "OVERLAP", step_module.OVERLAP):
        return _steps(device, quick, out, test_timeout_s, budget_s, log, compiled, result)


def _steps(device: str, quick: bool, out: Path, test_timeout_s: float, budget_s: float, log, compiled: bool,
           result: dict[str, Any]) -> dict[str, Any]:
    def step(key: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            result["steps"][key] = {"result": fn()}
        except Exception as e:  # noqa: BLE001 - one failing step must not lose the others' results
            result["steps"][key] = {"error": f"{type(e).__name__}: {e}"}
        result["steps"][key]["seconds"] = time.perf_counter() - t0
        log(f"gpu_check: {key} done in {result['steps'][key]['seconds']:.1f} s")
        write_file(out, json_text(result, indent=1, default=str) + "\n")  # what is done so far survives

    files = ["tests/test_step.py"] if quick else DEVICE_TESTS
    t_start = time.perf_counter()
    step("ahead", lambda: check_ahead(device))
    result["ahead_fallback"] = not keep_ahead(result["steps"]["ahead"], log)
    for shape, dtype in CASES:
        if quick:
            shape = "tiny"
        step(f"bench {shape} {dtype}", lambda s=shape, d=dtype: _bench(s, d, device, quick, log, compiled))
        if quick:
            break
    shape, dtype = ("tiny", "float32") if quick else CASES[-1]
    step(f"tiles {shape} {dtype}", lambda: sweep_tiles(shape, dtype, device, quick, log, compiled))
    if not quick:  # the 8B shape's is in the tiles step, beside its profile
        step(f"host {CASES[0][0]} {CASES[0][1]}", lambda: small_host_split(*CASES[0], device))
    for shape, dtype in CASES[:1] if quick else CASES:
        step(f"rows {'tiny' if quick else shape} {dtype}", lambda s=shape, d=dtype: row_probe.probe(s, d, device, quick))
    step("serve", lambda: identity.on_device(device, *((16, 4) if quick else (80, 16))))
    # The tests last, in whatever the loan has left (at least a minute): the figures above come first.
    left = max(60.0, budget_s - (time.perf_counter() - t_start)) if budget_s else test_timeout_s
    step("tests", lambda: run_tests(device, min(test_timeout_s, left), files, workers=0 if quick else 8))
    return result


def check_ahead(device: str) -> dict[str, bool]:
    """Whether decoding one step ahead of the host gives the answers of the host in step (tokens and every
    step's logits), greedy and sampled, on a tiny random model on `device`; and `minillama serve`'s engine
    one pass ahead the events it reports in step (`serve_greedy`, `serve_sampled`)."""
    from ..generate import SamplingParams, generate
    from .device import random_model
    from .parity import differing, workload
    from .shapes import SHAPES

    model, _ = random_model(SHAPES["tiny"], torch.device(device), torch.float32)
    prompts = workload(model.config.vocab_size, 40, 6, (2, 9))
    out = {}
    for sampled in (False, True):
        params = SamplingParams(max_new_tokens=6, keep_logits=True, ignore_eos=True, temperature=0.8 * sampled, seed=7)
        runs, served = [], []
        for ahead in (False, True):
            model.steps.overlap = ahead
            runs.append(generate(model, prompts, params, mode="parallel"))
            served.append(_served(model, prompts, params))
        d = differing(*runs)
        name = "sampled" if sampled else "greedy"
        out[name] = d["steps_differing"] == d["questions_with_other_tokens"] == 0
        out[f"serve_{name}"] = served[0] == served[1]
    return out


def _served(model: Any, prompts: list[list[int]], params: Any, together: bool = False) -> list[list[Any]]:
    """Each prompt's events (tokens, log-probs, top-2 log-probs, finish) from `minillama serve`'s engine,
    stepped on this thread, the prompts arriving one pass apart (`together`: all at once, with the server's
    default pass size and no top log-probs, as `engine_times` times it)."""
    from ..serve.engine import Choice, Engine

    engine = Engine(model, [model.config.eos_token_id], **({} if together else {"max_batch_tokens": 16}))
    events: list[list[Any]] = [[] for _ in prompts]
    arriving = [Choice(p, params, events[i].append, index=i, top_k=0 if together else 2) for i, p in enumerate(prompts)]
    if together:
        engine.submit(arriving)
        arriving = []
    while arriving or engine.waiting or engine.running:
        if arriving:
            engine.submit([arriving.pop(0)])
        with engine.lock:
            engine._admit()
        engine._step()
    return events


def keep_ahead(record: dict[str, Any], log) -> bool:
    """Whether the `ahead` step passed; if not, every later step of this check runs with the host in step
    (`step.OVERLAP`, put back when the check ends), and the log says so."""
    ok = "error" not in record and all(record["result"].values())
    if not ok:
        step_module.OVERLAP = False
        log(f"gpu_check: decoding ahead of the host FAILED ({record.get('error') or record.get('result')}): "
            "the rest of the check runs with the host in step")
    return ok


def small_host_split(shape: str, dtype_name: str, device_name: str) -> dict[str, Any]:
    """`host_split` of the headline task at a shape whose model is small enough to make for this step alone."""
    from .device import HEADLINE, random_model
    from .shapes import SHAPES

    device = torch.device(device_name)
    model, _ = random_model(SHAPES[shape], device, getattr(torch, dtype_name))
    prompts, docs = HEADLINE.build(model.config.vocab_size)
    return {"task": HEADLINE.describe(), "host": host_split(model, prompts, docs, HEADLINE.new_tokens, device),
            "serve_engine": engine_times(model, prompts, HEADLINE.new_tokens, device)}


# Runs before the timed ones: a bucket's first step runs eagerly and its second is captured (step.py), so a
# pass met once a run (a prefill chunk) is captured in the second run and replayed from the third. With one
# warm-up, the H200 run at f9e71c4 timed a capture in `host` at SmolLM2's shape (tests/test_bench.py).
WARM_RUNS = 2


def engine_times(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device,
                 repeats: int = 3) -> dict[str, float]:
    """Median wall seconds of `minillama serve`'s engine (no HTTP) answering `prompts`, all submitted at once
    to a fresh engine stepped on this thread, one pass ahead of the host and in step, each after `WARM_RUNS`
    runs; `in_step_over_ahead`, what running ahead gains there."""
    from ..generate import SamplingParams
    from .device import _sync

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    out = {}
    for name, overlap in (("ahead_s", True), ("in_step_s", False)):
        model.steps.overlap = overlap
        walls = []
        for _ in range(WARM_RUNS + repeats):
            _sync(device)
            t0 = time.perf_counter()
            _served(model, prompts, params, together=True)
            _sync(device)
            walls.append(time.perf_counter() - t0)
        out[name] = statistics.median(walls[WARM_RUNS:])
    model.steps.overlap = None
    out["in_step_over_ahead"] = out["in_step_s"] / out["ahead_s"]
    return out


def _candidates() -> dict[str, Any]:
    """Named sets of GPU tiles to time against the default (`invariant.CUDA_TILES`)."""
    from ..blocks import ItemTiles
    from ..invariant import CUDA_TILES as t

    replace, a = dataclasses.replace, t.attention
    whole64, partial8 = ItemTiles(rows=64, batch=256, chunk=8192), ItemTiles(rows=8, batch=1024, chunk=16384)
    return {"default": t,
            "no_short": t.whole_only(),  # every product and call whole: the GPU's tiles at f9e71c4
            "whole_items": replace(t, attention=t.whole_only().attention),  # short linear tiles, whole items
            "rows128": replace(t, rows=128),
            # 64-row tiles, runs of them as one product where proven: decode's 64 rows, prefill's big products
            "rows64_long": replace(t, rows=64, short=(16, 32), long=(512, 256)),
            "whole64_partial8": replace(t, attention=replace(a, whole=whole64, partial=partial8)),  # until 2026-11-27
            "whole64": replace(t, attention=replace(a, whole=whole64)),
            "partial8": replace(t, attention=replace(a, partial=partial8)),
            "whole256": replace(t, attention=replace(a, whole=ItemTiles(rows=256, batch=64, chunk=8192))),
            "partial32": replace(t, attention=replace(a, partial=ItemTiles(rows=32, batch=256, chunk=16384)))}


def sweep_tiles(shape: str, dtype_name: str, device_name: str, quick: bool, log, compiled: bool = False
                ) -> dict[str, Any]:
    """`parallel` on the headline task with each candidate set of tiles (round-robin, medians), and a
    profile of one run with the default tiles: the ops that take the most device and host time; `compiled`,
    a profile of one run with compiled steps too (after one that compiles its shapes or reads them)."""
    from .device import HEADLINE, _run_minillama, _sync, random_model
    from .shapes import SHAPES

    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    model, _ = random_model(SHAPES[shape], device, dtype)
    task = dataclasses.replace(HEADLINE, doc_tokens=32, questions=4, question_tokens=3, new_tokens=3) if quick else HEADLINE
    prompts, docs = task.build(model.config.vocab_size)
    cands = _candidates()

    def once(name: str) -> tuple[float, list[list[int]]]:
        model.kernels.tiles = cands[name]
        _sync(device)
        t0 = time.perf_counter()
        out = _run_minillama(model, prompts, docs, task.new_tokens, "parallel", invariant=True)
        _sync(device)
        return time.perf_counter() - t0, out

    times: dict[str, list[float]] = {n: [] for n in cands}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for n in cands:
            once(n)  # warm-up
        for r in range(1 if quick else 3):
            for n in cands:
                t, tokens[n] = once(n)
                times[n].append(t)
        profile = {"profile": _profile(lambda: once("default"), device),
                   "host": host_split(model, prompts, docs, task.new_tokens, device)}
        if compiled:
            model.kernels.tiles = cands["default"]
            run = lambda: _run_minillama(model, prompts, docs, task.new_tokens, "parallel", True, compiled=True)  # noqa: E731
            run()
            profile["profile_compiled"] = _profile(run, device)
    finally:
        model.kernels.tiles = None
    base = statistics.median(times["default"])
    rows = {n: {"wall_s": statistics.median(ts), "wall_s_all": ts, "x_default": statistics.median(ts) / base,
                "same_tokens_as_default": sum(a == b for a, b in zip(tokens[n], tokens["default"]))}
            for n, ts in times.items()}
    for n, r in rows.items():
        log(f"  tiles {n}: {r['wall_s']:.3f} s, x{r['x_default']:.2f} the default")
    return {"task": task.describe(), "candidates": {n: repr(c) for n, c in cands.items()}, "runs": rows,
            "proofs": proofs_made(), **profile}


def proofs_made() -> list[dict[str, Any]]:
    """Every proof this process made: which short linear tiles (and units as one product) the device showed
    give a tile's bits, per operand's shape, layout and dtype (proofs.py); which short item tiles and batches
    of each kind of attention item, per head size (batched.py); and so which the runs took."""
    from .. import batched, proofs

    linear = [{"kind": key.kind, "shape": key.shape, "stride": key.stride, "dtype": str(key.dtype),
               "proven": list(value) if key.kind != "units" else bool(value)} for key, value in proofs._PROVEN.items()]
    return linear + [{"kind": f"attention {key.kind}", "tile": [key.tiles.rows, key.tiles.batch],
                      "head_dim": key.shape[0], "dtype": str(key.dtype), "proven": list(value)}
                     for key, value in batched._PROVEN.items() if key.kind in ("batches", "rows")]


def host_split(model: Any, prompts: list[list[int]], docs: list[int], new_tokens: int,
               device: torch.device) -> dict[str, dict[str, float]]:
    """Where one `parallel` run's wall time goes on the host, with the host one decode step ahead (the
    default on a GPU) and in step: laying out its passes (`Llama.lay_out`), waiting for the device to hand
    a step's tokens back (`transfer.Later.tolist`), and the rest (launching, choosing, recording). Mostly
    waiting: the device is the bound; mostly laying out: the host is. Each timed run after `WARM_RUNS`."""
    from .. import transfer
    from .device import _run_minillama, _sync

    spent = {"lay_out_s": 0.0, "wait_s": 0.0}

    def timed(key: str, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t0
        return run

    out = {}
    with mock.patch.object(model, "lay_out", timed("lay_out_s", model.lay_out)), \
            mock.patch.object(transfer.Later, "tolist", timed("wait_s", transfer.Later.tolist)):
        for name, overlap in (("ahead", None), ("in_step", False)):
            for _ in range(WARM_RUNS):
                _run_minillama(model, prompts, docs, new_tokens, "parallel", True, overlap=overlap)
            spent.update(lay_out_s=0.0, wait_s=0.0)
            _sync(device)
            t0 = time.perf_counter()
            _run_minillama(model, prompts, docs, new_tokens, "parallel", True, overlap=overlap)
            _sync(device)
            wall = time.perf_counter() - t0
            out[name] = {"wall_s": wall, **spent, "other_s": wall - sum(spent.values())}
    return out


def _profile(run, device: torch.device, top: int = 30) -> dict[str, str]:
    """The top ops of one run by device time and by host time, as torch.profiler's tables."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        run()
    ka = prof.key_averages()
    by = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return {"by_device_time": ka.table(sort_by=by, row_limit=top),
            "by_host_time": ka.table(sort_by="self_cpu_time_total", row_limit=top)}


def _bench(shape: str, dtype: str, device: str, quick: bool, log, compiled: bool = False) -> dict[str, Any]:
    from .device import shape_main

    data = shape_main(shape, device, dtype, tiny=quick, tables=False, repeats=1 if quick else 3,
                      sample=2 if quick else 4, use_hf=True, log=log, parity_check=True, compiled=compiled,
                      units=True)
    if compiled and (quick or (shape, dtype) == CASES[0]):  # a second process on the cache this one filled
        data["meta"]["compiled_warm"] = warm.warm_run(shape, dtype, device, quick, timeout_s=120.0)
    return {**data, "targets": targets(data)}


def main(argv: Sequence[str] | None = None) -> int:
    def go() -> int:
        ap = argparse.ArgumentParser(prog="python -m minillama.bench.gpu_check", description=__doc__.splitlines()[0])
        ap.add_argument("--device", default="cuda", help="default: cuda")
        ap.add_argument("--quick", action="store_true", help="tiny sizes and one test file: seconds (tests)")
        ap.add_argument("--out", help="JSON to write (default: docs/bench/gpu/<device>-check.json)")
        ap.add_argument("--test-timeout", type=float, default=300.0, help="seconds for the test run at most (default: 300)")
        ap.add_argument("--budget", type=float, default=0.0,
                        help="seconds for the whole check: the tests, run last, get what is left (default: no bound)")
        ap.add_argument("--compiled", action="store_true",
                        help="the parity checks and the bench also with compiled steps, compiled from cold")
        a = ap.parse_args(argv)
        if a.device.startswith("cuda") and not torch.cuda.is_available():
            raise BadInput("--device cuda: torch sees no CUDA device here (--device cpu runs the same steps)")
        check_device(a.device)  # a name torch does not know was a JSON of failed steps, exit 0
        name = torch.cuda.get_device_name(0) if a.device.startswith("cuda") else a.device
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        out = Path(a.out) if a.out else ROOT / "docs" / "bench" / "gpu" / f"{slug}-check.json"
        check(a.device, a.quick, out, a.test_timeout, a.budget, compiled=a.compiled)
        print(f"gpu_check: wrote {out}")
        return 0

    return run_command(go)


if __name__ == "__main__":
    sys.exit(main())
