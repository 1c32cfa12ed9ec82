"""The compile cache across processes: what a second compiled run pays before its first token.

    python -m minillama.bench.warm smollm2 float32 cuda    # one JSON line: this process's compiled runs

A compiled run leaves its code in the cache directory ($TORCHINDUCTOR_CACHE_DIR, step.py); a later process on
the same directory traces the same steps and reads their code from there rather than compiling it.
`warm_run` times that in a fresh process, on the headline task at a named shape with random weights (the
weights' values are no part of a graph): its first compiled run (tracing, loading), a second (the steady
time), and Inductor's graph cache hits and misses in the first (no miss: nothing compiled cold).
gpu_check runs it after the shape bench's cold first run, on the same directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .device import HEADLINE, compiled_run_s, random_model, shrunk
from .shapes import SHAPES

ROOT = Path(__file__).resolve().parents[2]


def runs(shape: str, dtype_name: str, device_name: str, tiny: bool) -> dict[str, Any]:
    """This process's first and second compiled runs of the headline, and the first's graph cache counts."""
    from torch._dynamo.utils import counters

    device = torch.device(device_name)
    model, _ = random_model(SHAPES[shape], device, getattr(torch, dtype_name))
    task = shrunk(HEADLINE, tiny)
    counters.clear()
    first = compiled_run_s(model, task, device)
    hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
    return {"first_run_s": first, "steady_s": compiled_run_s(model, task, device), "graph_cache_hits": hits,
            "graph_cache_misses": misses}


def warm_run(shape: str, dtype_name: str, device_name: str, tiny: bool, timeout_s: float = 300.0) -> dict[str, Any]:
    """`runs` in a fresh process on this one's cache directory; `process_s`: that process's whole wall time
    (starting Python and torch, drawing the weights, both runs). Its failure, or `timeout_s` passing, is
    `{"error": ...}`: the caller's other figures stay."""
    # As many threads as this process: Inductor's CPU code, and so its cache key, holds the thread count.
    cmd = [sys.executable, "-m", "minillama.bench.warm", shape, dtype_name, device_name, *(["--tiny"] if tiny else []),
           "--threads", str(torch.get_num_threads())]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"the second process took more than {timeout_s:g} s"}
    if proc.returncode != 0:
        return {"error": f"the second process failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"}
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t0}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillama.bench.warm", description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("dtype", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("device")
    ap.add_argument("--tiny", action="store_true", help="the headline's sizes divided down (tests)")
    ap.add_argument("--threads", type=int, help="torch's threads (default: torch's choice)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(json.dumps(runs(a.shape, a.dtype, a.device, a.tiny)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
