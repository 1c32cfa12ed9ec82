"""More than one process, on torch.distributed with gloo: tensor and data parallel, bit-exact at every degree.

Real process groups on this CPU, started with torchrun (`python -m torch.distributed.run --standalone`), each
run bounded in time. The tensor-parallel ranks run tests/_dist_worker.py on a tiny model with 8 KV heads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _dist_worker as worker  # noqa: E402

ROOT = Path(__file__).parent.parent
EXAMPLES = max(1, int(os.environ.get("MINILLAMA_EXAMPLES", "200")) // 20)  # per dtype and degree


def torchrun(nproc: int, *args: str, timeout: float = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def run_worker(tmp_path, nproc: int, tp: int, *extra: str) -> dict:
    out = tmp_path / f"tp{tp}_{nproc}{'_'.join(extra)}.pt"
    proc = torchrun(nproc, "tests/_dist_worker.py", str(out), "--tp", str(tp), "--examples", str(EXAMPLES), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def one_process():
    """The fixed workload's logits in one process, with the products issued in the same 8 units."""
    return {dtype: worker.answers_of(worker.build(dtype)) for dtype in (torch.float32, torch.bfloat16)}


def same_logits(a, b) -> bool:
    return all(torch.equal(x, y) for qa, qb in zip(a, b, strict=True) for x, y in zip(qa, qb, strict=True))


@pytest.mark.parametrize("nproc,tp", [(2, 2), (4, 4), (4, 2)])
def test_tensor_parallel_parity_and_degree_invariance(tmp_path, one_process, nproc, tp):
    """At tp=2, tp=4, and two data-parallel groups of tp=2: the parity property (parallel == independent) in
    float32 and bfloat16, prefill == decode, every rank holding the same answers, and the logits equal to the
    bit to one process's (tp=1 == tp=2 == tp=4)."""
    r = run_worker(tmp_path, nproc, tp)
    assert (r["world"], r["tp"]) == (nproc, tp)
    assert r["ranks_agree"]
    for dtype in (torch.float32, torch.bfloat16):
        assert r[f"parity_{dtype}"] == EXAMPLES
        assert r[f"prefill_equals_decode_{dtype}"], f"{dtype}: a generated token's logits differ from prefill's"
        assert same_logits(one_process[dtype], r[f"logits_{dtype}"]), f"{dtype}: tp={tp} differs from one process"
        assert r[f"bytes_{dtype}"] > 0


def test_negative_control_all_reduce_breaks_degree_invariance(tmp_path, one_process):
    """The same run at tp=4 with a plain all_reduce adding the partials: the bits move."""
    r = run_worker(tmp_path, 4, 4, "--plain")
    for dtype in (torch.float32, torch.bfloat16):
        assert not same_logits(one_process[dtype], r[f"logits_{dtype}"]), f"{dtype}: the control shows nothing"


def test_units_are_a_property_of_the_products(one_process):
    """In one process, issuing the products whole rather than in 8 units changes the bits: the units, not the
    degree, fix the arithmetic (which is why tp=1 must use the same units to match tp=N)."""
    model = worker.build(torch.float32)
    model.units = 1
    assert not same_logits(one_process[torch.float32], worker.answers_of(model))
