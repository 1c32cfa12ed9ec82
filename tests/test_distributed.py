"""More than one process, on torch.distributed with gloo: tensor and data parallel, bit-exact at every degree.

Real process groups on this CPU, started with torchrun (`python -m torch.distributed.run --standalone`), each
run bounded in time. The tensor-parallel ranks run tests/_dist_worker.py on a tiny model with 8 KV heads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _dist_worker as worker  # noqa: E402
from test_signatures import with_short_tiles  # noqa: E402
from tiny import SMALL_TILES  # noqa: E402

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


@pytest.fixture(scope="module")
def one_process_signatures():
    return {dtype: worker.product_signatures(worker.build(dtype)) for dtype in (torch.float32, torch.bfloat16)}


def same_logits(a, b) -> bool:
    return all(torch.equal(x, y) for qa, qb in zip(a, b, strict=True) for x, y in zip(qa, qb, strict=True))


@pytest.mark.parametrize("nproc,tp", [(2, 2), (4, 4), (4, 2), (8, 8)])
def test_tensor_parallel_parity_and_degree_invariance(tmp_path, one_process, one_process_signatures, nproc, tp):
    """At tp=2, 4 and 8, and two data-parallel groups of tp=2: the parity property (parallel == independent) in
    float32 and bfloat16, prefill == decode, every rank holding the same answers, the logits equal to the
    bit to one process's (tp=1 == 2 == 4 == 8), and every product a rank issues has a signature one process
    issues too, or a short tile's or batch's form of one (a rank holds fewer KV heads, so fewer attention
    items: its last batch may take another proven short count), the property that carries the argument to
    devices this machine cannot run."""
    r = run_worker(tmp_path, nproc, tp)
    assert (r["world"], r["tp"]) == (nproc, tp)
    assert r["ranks_agree"]
    for dtype in (torch.float32, torch.bfloat16):
        assert r[f"parity_{dtype}"] == EXAMPLES
        assert r[f"prefill_equals_decode_{dtype}"], f"{dtype}: a generated token's logits differ from prefill's"
        assert same_logits(one_process[dtype], r[f"logits_{dtype}"]), f"{dtype}: tp={tp} differs from one process"
        assert r[f"bytes_{dtype}"] > 0
        issued = with_short_tiles(one_process_signatures[dtype], SMALL_TILES)  # a rank's fewer heads: other short batches
        assert r[f"signatures_{dtype}"] <= issued, "a product signature one process never issues"


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_negative_control_all_reduce_breaks_degree_invariance(tmp_path, one_process, tp):
    """The same run with the partials added as a serving engine adds them (each rank's in turn, then a plain
    all_reduce): the bits move at every degree tested. At tp=2 the all_reduce alone would be the tree's
    root (a + b); the in-turn sum inside a rank is what the test sees there."""
    r = run_worker(tmp_path, tp, tp, "--plain")
    for dtype in (torch.float32, torch.bfloat16):
        assert not same_logits(one_process[dtype], r[f"logits_{dtype}"]), f"{dtype}: the control shows nothing"


def test_units_are_a_property_of_the_products(one_process):
    """In one process, issuing the products whole rather than in 8 units changes the bits: the units, not the
    degree, fix the arithmetic (which is why tp=1 must use the same units to match tp=N)."""
    model = worker.build(torch.float32)
    model.units = 1
    assert not same_logits(one_process[torch.float32], worker.answers_of(model))


# --- the command line: data parallel (and data x tensor) through --procs and torchrun ----------------------

from minillama.weights import save_hf_dir  # noqa: E402
from test_api import DOC, QUESTIONS, tiny_tokenizer  # noqa: E402
from tiny import tiny_config, tiny_model  # noqa: E402

DOCS = [DOC, "Tay is the longest river in Scotland. It flows into the North Sea at Dundee.",
        "The Forth Bridge is a railway bridge over the Firth of Forth, opened in 1890.",
        "Ben Nevis, near Fort William, is the highest mountain in the British Isles."]


N_QUESTIONS = sum(len(QUESTIONS[: 2 + i]) for i in range(len(DOCS)))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A tiny HF checkpoint with 4 KV heads (so --tp 2 and --tp 4 shard it) and a ChatML tokenizer."""
    tok = tiny_tokenizer()
    config = tiny_config(layers=2, heads=8, kv_heads=4, head_dim=8, vocab=tok.vocab_size, max_pos=512, tied=True)
    return save_hf_dir(config, tiny_model(config, seed=3).state_dict(), tok, tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Path:
    """Four documents of different lengths, 2 to 5 questions each."""
    path = tmp_path_factory.mktemp("in") / "jobs.jsonl"
    rows = [{"doc": d, "questions": QUESTIONS[: 2 + i]} for i, d in enumerate(DOCS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def generate(*args, procs: int = 0, torchrun_nproc: int = 0, timeout: float = 400) -> subprocess.CompletedProcess:
    cli = ["-m", "minillama", "generate", *map(str, args)]
    if torchrun_nproc:
        return torchrun(torchrun_nproc, *cli, timeout=timeout)
    cmd = [sys.executable, *cli, *(["--procs", str(procs)] if procs else [])]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def common(ckpt, jobs, *extra) -> list:
    return ["--model", ckpt, "--input", jobs, "--json", "--logprobs", "-n", "6", "--temperature", "0.9",
            "--seed", "5", *extra]


@pytest.fixture(scope="module")
def one(ckpt, jobs):
    """One process with default options (the products in 4 units, one a KV head) and with --units 1."""
    out = {}
    for units in (None, 1):
        p = generate(*common(ckpt, jobs, *(["--units", str(units)] if units else [])))
        assert p.returncode == 0, p.stderr
        out[units] = p.stdout
    assert out[None].count("\n") == N_QUESTIONS
    return out


def test_data_parallel_output_is_byte_identical(ckpt, jobs, one):
    """Two ranks (--procs 2) and torchrun's two: the same bytes as one process, sampled answers included."""
    for p in (generate(*common(ckpt, jobs), procs=2), generate(*common(ckpt, jobs), torchrun_nproc=2)):
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout == one[None]
        s = json.loads(p.stderr.strip().splitlines()[-1])
        assert (s["ranks"], s["dp"], s["tp"], s["questions"]) == (2, 2, 1, N_QUESTIONS)


def test_data_by_tensor_parallel_output_is_byte_identical(ckpt, jobs, one):
    """Four ranks as two groups of --tp 2, and one group of --tp 4, with no other flag: one process's bytes
    with default options (both issue the products in one unit a KV head); --units 1 too, on every rank."""
    for procs, tp, extra in ((4, 2, ()), (4, 4, ()), (2, 1, ("--units", "1"))):
        p = generate(*common(ckpt, jobs, "--tp", str(tp), *extra), procs=procs)
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout == one[1 if extra else None], f"--procs {procs} --tp {tp} {extra}"


def test_a_rank_that_rank_0_takes_nothing_from_says_why(ckpt, tmp_path):
    """Rank 0 blocked writing to a pipe nobody read (a pager left open): the other rank's send timed out and it
    ended quietly, as if rank 0 had said why; the run ended with exit 2 and not a word."""
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"doc": DOCS[0], "questions": QUESTIONS[:3]}) + "\n" for _ in range(150)))
    proc = subprocess.Popen([sys.executable, "-m", "minillama", "generate", "--model", str(ckpt), "--input", str(big),
                             "--json", "-n", "4", "--mode", "independent", "--procs", "2", "--dist-timeout", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    time.sleep(20)  # rank 0 fills the pipe (64 KiB) and waits; rank 1's send times out
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and out.count(b"\n") < 450
    assert "rank 0 took no answer within --dist-timeout" in err.decode(), err.decode()[-2000:]


def test_an_omp_thread_count_that_is_no_count_is_passed_over(ckpt, jobs, one):
    """OMP_NUM_THREADS=abc (or 0, or 1.5), which OpenMP passes over with a warning, ended every --procs rank with a
    traceback (int("abc")); the ranks now share the cores out as they do with it unset."""
    for value in ("abc", "0", "²"):
        p = subprocess.run([sys.executable, "-m", "minillama", "generate", *map(str, common(ckpt, jobs)), "--procs",
                            "2"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": value})
        assert p.returncode == 0 and p.stdout == one[None], p.stderr[-3000:]


def test_each_ranks_thread_count_is_a_count_or_the_default():
    """"²" is a digit to str.isdigit but no number to int: it ended the launcher with a traceback."""
    from minillama.distributed.launch import _thread_count

    for given, want in ((None, "3"), ("", "3"), ("abc", "3"), ("0", "3"), ("²", "3"), ("1²", "3"), ("٣", "3"),
                        ("1.5", "3"), (" 2 ", "2"), ("4", "4")):
        assert _thread_count(given, 3) == want, given


def test_ctrl_c_under_torchrun_is_said_once_by_the_rank_that_writes(ckpt, tmp_path):
    """Ctrl-C reaches every rank: each said "interrupted: K of N answers written", rank 1 with its own count
    (0), beside rank 0's."""
    import signal

    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"doc": DOCS[0], "questions": QUESTIONS[:3]}) + "\n" for _ in range(150)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "minillama",
           "generate", "--model", str(ckpt), "--input", str(big), "--json", "-n", "4", "--mode", "independent"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    first = proc.stdout.readline().decode()  # answers are coming: both ranks are at work (unbuffered: see below)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C, to the whole group
    out, err = (b.decode() for b in proc.communicate(timeout=120))
    said = [line for line in err.splitlines() if line.startswith("interrupted:")]
    assert first and len(said) == 1, err[-3000:]
    assert said[0] == f"interrupted: {1 + out.count(chr(10))} of 450 answers written", (said, err[-2000:])


def test_ctrl_c_under_procs_is_said_by_rank_0_with_its_count(ckpt, tmp_path):
    """Ctrl-C to --procs' whole process group (a terminal's): the launcher ended rank 0 at once and said only
    "interrupted"; it now leaves rank 0 the grace to say "interrupted: K of N answers written", as one process
    and torchrun do, and says nothing itself. No rank outlives the launcher."""
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"doc": DOCS[0], "questions": QUESTIONS[:3]}) + "\n" for _ in range(150)))
    cmd = [sys.executable, "-m", "minillama", "generate", "--model", str(ckpt), "--input", str(big), "--json",
           "-n", "4", "--mode", "independent", "--procs", "2"]
    # Unbuffered bytes: a buffered readline() would keep the lines read with the first (answers that come
    # together), which communicate() (reading the pipe itself) never sees: rank 0 said "3 of 450", one was seen.
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        first = proc.stdout.readline().decode()  # answers are coming: both ranks are at work
        ranks = _children(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = (b.decode() for b in proc.communicate(timeout=120))
    finally:
        proc.kill()
    time.sleep(1)
    alive = [p for p in ranks if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived their launcher"
    said = [line for line in err.splitlines() if line.startswith("interrupted")]
    assert first and proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert said == [f"interrupted: {1 + out.count(chr(10))} of 450 answers written"], (said, err[-2000:])


def test_two_nodes_over_loopback_rendezvous(ckpt, jobs, one):
    """Two torchrun "nodes" of one rank each, meeting at a c10d rendezvous on 127.0.0.1."""
    from minillama.distributed.launch import free_port

    port = free_port()
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                        "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                        "--rdzv-id=minillama-test", "-m", "minillama", "generate",
                        *map(str, common(ckpt, jobs))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nodes = [subprocess.Popen(cmd(n), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    try:
        outs = [n.communicate(timeout=400) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[0][0] + outs[1][0] == one[None]  # rank 0's node writes everything, the other nothing


@pytest.mark.parametrize("args,message", [
    (["--tp", "3", "--procs", "3"], "--tp 3: the model's 4 KV heads do not divide into 3 ranks; --tp must divide 4: "
                                    "1, 2 or 4"),
    (["--tp", "2"], "--tp 2 needs a multiple of 2 processes"),
    (["--tp", "2", "--procs", "3"], "--tp 2 needs a multiple of 2 processes, got --procs 3"),
    (["--units", "3"], "--units 3: must divide the model's 4 KV heads: 1, 2 or 4"),
    (["--units", "2", "--tp", "4", "--procs", "4"], "--units 2: --tp 4 must divide it"),
    (["--procs", "0"], "--procs must be at least 1"),
    (["--dist-timeout", "0"], "--dist-timeout must be a number of seconds > 0"),
    (["--dist-timeout", "1e14", "--procs", "2"], "--dist-timeout must be a number of seconds > 0, from 0.001 to "),
    (["--dist-timeout", "1e-9", "--procs", "2"], "--dist-timeout must be a number of seconds > 0, from 0.001 to "),
])
def test_bad_distributed_options(ckpt, jobs, args, message):
    p = generate("--model", ckpt, "--input", jobs, *args)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"error: {p.stderr.strip()[7:]}"] and message in p.stderr, p.stderr


@pytest.mark.parametrize("args,env", [
    (["--tp", "3", "--procs", "3"], {}),
    (["--units", "3"], {}),
    (["--tp", "3"], {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0"}),  # a rank torchrun started
])
def test_a_bad_degree_is_refused_before_any_rank_starts_or_reads_a_weight(ckpt, jobs, monkeypatch, capsys, args, env):
    """The degree and units are checked against the checkpoint's config (its KV heads) in the command's own
    option checks: no rank is started, no process group joined, no weight file opened. Seen without
    timing: each of those is replaced by a marker that records being reached."""
    from minillama import cli
    from minillama.distributed import launch, parallel
    from minillama.weights import hf, load

    reached = []
    for module, name in ((launch, "run"), (parallel, "join"), (load, "load_model"), (hf, "_read_hf_dir")):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: reached.append(_n))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = cli.main(["--model", str(ckpt), "--input", str(jobs), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "4 KV heads" in err[0] and "1, 2 or 4" in err[0], err
    assert reached == []


def test_a_planted_token_divergence_stops_every_rank_in_one_line(tmp_path):
    """Rank 1 samples with another seed than rank 0 (as a rank on different hardware might): the first step's
    tokens differ, every rank stops there, one line says which, the exit status is not 0, nothing hangs."""
    proc = torchrun(2, "tests/_dist_worker.py", str(tmp_path / "x"), "--tp", "2", "--diverge", timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: tensor-parallel rank 1 chose token"), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def big_ckpt(tmp_path_factory) -> tuple[Path, dict]:
    """An HF checkpoint in three files, 302 MiB of split weights (24 layers at hidden 512) against 0.6 MiB
    replicated: big enough that a rank holding a quarter of it and one holding all of it are told apart, and
    that a rank's few MiB of its own (first imports, the tokenizer) stay well inside the 25% (at 12 layers a
    rank of four came within 2% of the bound, over it on a loaded machine)."""
    from minillama.distributed.tp import slices
    from minillama.model import Llama
    from minillama.weights import expected_shapes

    sys.path.insert(0, str(Path(__file__).parent))
    from _ckpt_writers import write_hf_dir

    tok = tiny_tokenizer()
    config = tiny_config(layers=24, heads=8, kv_heads=4, head_dim=64, vocab=tok.vocab_size, max_pos=512)
    g = torch.Generator().manual_seed(0)
    sd = {name: (torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape, generator=g))
          for name, shape in expected_shapes(config).items()}
    path = write_hf_dir(tmp_path_factory.mktemp("big") / "ckpt", config, sd, tok, shards=3)
    with torch.device("meta"):
        model = Llama(config)
    model.units = 4
    split = slices(model, range(4))
    sizes = {"sharded": sum(sd[n].numel() * 4 for n in split), "replicated": sum(
        t.numel() * 4 for n, t in sd.items() if n not in split)}
    sizes["largest"] = max(sd[n].numel() * 4 for n in split)
    return path, sizes


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_holds_only_its_part_of_the_checkpoint(tmp_path, big_ckpt, tp):
    """Per rank, the peak resident memory of loading is at most (split weights / tp) + replicated + the
    largest tensor's part, + 25%; the parts equal the whole model's, sharded. The control: loading the whole
    checkpoint first, as before, breaks the bound on every rank."""
    path, sizes = big_ckpt
    bound = 1.25 * (sizes["sharded"] / tp + sizes["replicated"] + sizes["largest"] / tp)
    for whole in (False, True):
        out = tmp_path / f"load{tp}{whole}.pt"
        proc = torchrun(tp, "tests/_dist_worker.py", str(out), "--tp", str(tp), "--load", str(path),
                        *(["--whole"] if whole else []), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = torch.load(out)
        assert all(r["same_parts"] for r in ranks)
        peaks = [r["peak_kib"] * 1024 for r in ranks]
        if whole:
            assert all(p > bound for p in peaks), (peaks, bound)
        else:
            assert all(p <= bound for p in peaks), (peaks, bound)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_process_holds_the_checkpoint_once(big_ckpt, dtype):
    """One process's load peak is the model's weights + 15% (in bfloat16 + 35%, and one float32 tensor as read: the
    float32 reads freed between the kept casts leave holes in malloc's heap, at this checkpoint's 1-3 MB tensors;
    the default model's bfloat16 peak is 1.2x its weights): each weight the model stores column-major (o and down
    always; q, k, v, gate and up on a CPU in float32) is read straight into that layout, and each tensor is cast as
    it is read (the whole float32 checkpoint was read first: twice the bfloat16 weights). The control: a state dict
    read whole (memory-mapped) and laid out after, as `load_model` did, holds the mapped pages beside the copies (in
    float32 about twice the weights; in bfloat16 the float32 pages beside their casts, three times)."""
    path, sizes = big_ckpt
    weights = sizes["sharded"] + sizes["replicated"]  # the checkpoint's, float32
    bound = 1.15 * weights if dtype == "float32" else 1.35 * weights / 2 + sizes["largest"]
    code = textwrap.dedent("""
        import sys, torch
        from minillama.bench.memory import PeakRSS
        from minillama.weights import build_model, load_model, load_state_dict
        import minillama.model, safetensors.torch  # imported before the peak is taken
        dtype = getattr(torch, sys.argv[2])
        with PeakRSS() as p:
            if sys.argv[3] == "whole":
                model = build_model(*load_state_dict(sys.argv[1]), dtype=dtype)
            else:
                model, _ = load_model(sys.argv[1], dtype=dtype)
        print(p.delta)""")
    for how in ("load_model", "whole"):
        proc = subprocess.run([sys.executable, "-c", code, str(path), dtype, how], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        delta = int(proc.stdout)
        assert (delta <= bound) == (how == "load_model"), (how, delta, bound)


def test_oracle_export_ranks_read_only_their_parts(tmp_path, big_ckpt):
    """`oracle export --tp 2` read the whole checkpoint on every rank, then sharded it: each rank's peak held all
    the split weights, as one process's does. Now each reads its part, as generate's ranks do: its peak is
    below one process's by most of the half it does not hold. Peaks: the largest process's resident memory, as
    the kernel counts it for a fresh parent's children (RUSAGE_CHILDREN)."""
    path, sizes = big_ckpt
    (tmp_path / "p.jsonl").write_text("[1, 20, 30, 40]\n")

    def peak(*launch: str, tp: int = 1) -> int:
        export = [*launch, "-m", "minillama", "oracle", "export", "--model", str(path), "-n", "1", "--prompt-ids",
                  str(tmp_path / "p.jsonl"), "-o", str(tmp_path / f"r{tp}.safetensors"), "--tp", str(tp)]
        code = ("import resource, subprocess, sys\n"
                "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
                "assert p.returncode == 0, p.stderr[-3000:]\n"
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        proc = subprocess.run([sys.executable, "-c", code, sys.executable, *export], cwd=ROOT,
                              capture_output=True, text=True, timeout=400, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(proc.stdout) * 1024

    one = peak()
    ranks = peak("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", tp=2)
    assert ranks < one - 0.35 * sizes["sharded"], (ranks, one, sizes)


def test_a_failing_rank_is_named_and_written_answers_stay(ckpt, tmp_path):
    """seqbatch on a document whose stream outgrows the context, held by rank 1: one line naming rank 1,
    exit 2, and rank 0's answers, already written, complete."""
    path = tmp_path / "jobs.jsonl"
    # the first document costs more tokens (rank 0 takes it) but its stream fits; the second's does not
    rows = [{"doc": DOC * 8, "questions": QUESTIONS[:1]}, {"doc": DOCS[1], "questions": QUESTIONS * 5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = generate("--model", ckpt, "--input", path, "--json", "--mode", "seqbatch", "-n", "2", "--ignore-eos",
                 procs=2)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("error: rank 1: seqbatch stream is longer than the model's context"), p.stderr
    order = [(0, 0)] + [(1, q) for q in range(len(QUESTIONS) * 5)]
    # JSON Lines end at "\n" only: an answer may hold a raw U+2028 or U+0085, which splitlines() breaks at
    written = [(r["doc_index"], r["question_index"]) for r in map(json.loads, p.stdout.split("\n")[:-1])]
    assert written == order[:len(written)]  # whole lines, in input order, none after a gap


def test_an_error_in_a_tensor_parallel_group_keeps_its_last_answer(ckpt, tmp_path):
    """--procs 4 --tp 2, seqbatch outgrowing the context in the second group: both of its ranks fail; the one
    that does not send answers reported too, and its report overtook the sending rank's last answer (rank 0
    ends at the first report): one answer fewer than one process writes."""
    path = tmp_path / "jobs.jsonl"
    rows = [{"doc": "Paris is the capital of France.", "questions": ["What is it?", "Where?"]},
            {"doc": "Paris is the capital of France. Again.", "questions": ["What is it?", "Where?"]},
            {"doc": DOC, "questions": [f"Question number {i} about the bridge?" for i in range(40)]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ("--model", ckpt, "--input", path, "--json", "-n", "8", "--mode", "seqbatch")
    one, four = generate(*args), generate(*args, "--tp", "2", procs=4)
    assert one.returncode == four.returncode == 2, (one.stderr[-2000:], four.stderr[-2000:])
    assert "seqbatch stream is longer than the model's context" in four.stderr.strip().splitlines()[-1]
    assert one.stdout.count("\n") > 4 and four.stdout == one.stdout


@pytest.mark.parametrize("kind, launcher", [("bug", "procs"), ("refusal", "procs"), ("oom", "procs"),
                                           ("bug", "torchrun"), ("hang", "procs")])
def test_an_error_one_tensor_parallel_rank_alone_meets_ends_the_run_at_once(ckpt, jobs, kind, launcher):
    """--tp 2, one data-parallel group: rank 1 alone fails in its third forward pass (its own device out of
    memory, say) while rank 0 waits on it in a collective, with no thread that could hear a report. Rank 1 says
    so in one line (a bug's traceback before it) and its launcher ends the run, long before --dist-timeout
    (600 s; the subprocess has 200). A rank 1 that stops answering: rank 0 says so, in one line, at the timeout."""
    args = ["generate", "--model", ckpt, "--input", jobs, "--json", "-n", "6", "--tp", "2",
            "--dist-timeout", "20" if kind == "hang" else "600"]
    script = ["tests/_dist_rank_fault.py", kind, *map(str, args)]
    if launcher == "torchrun":
        p = torchrun(2, *script, timeout=200)
    else:
        p = subprocess.run([sys.executable, *script, "--procs", "2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    if kind == "hang":
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
        assert len(said) == 1 and said[0].startswith("error: lost contact with another rank in a collective ("), said
        assert said[0].endswith("; the answers written so far are complete"), said
        return
    planted = "planted: rank 1's device is out of memory"
    assert said == [f"error: rank 1: {f'out of memory ({planted})' if kind == 'oom' else planted}"], p.stderr[-3000:]
    assert ("Traceback" in p.stderr) == (kind == "bug"), p.stderr[-3000:]
    assert p.returncode == (1 if kind == "bug" or launcher == "torchrun" else 2), p.stderr[-3000:]
    if launcher == "procs":
        assert p.stderr.strip().splitlines()[-1] == said[0], p.stderr[-3000:]


@pytest.mark.parametrize("kind", ["oom", "refusal"])
def test_an_error_on_another_data_parallel_rank_is_one_line(ckpt, jobs, kind):
    """Two data-parallel ranks, rank 1 failing in its third forward pass: rank 0 says rank 1's line, and rank 1
    ends quietly. Out of memory was said twice: rank 1 sent its line to rank 0, then said it again itself
    through the one error runner (which says out of memory on any rank)."""
    args = ["generate", "--model", ckpt, "--input", jobs, "--json", "-n", "6", "--mode", "independent",
            "--procs", "2"]
    p = subprocess.run([sys.executable, "tests/_dist_rank_fault.py", kind, *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    planted = "planted: rank 1's device is out of memory"
    said = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert said == [f"error: rank 1: {f'out of memory ({planted})' if kind == 'oom' else planted}"], p.stderr[-3000:]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_a_data_parallel_rank_that_stops_answering_ends_the_run_with_status_2(ckpt, jobs):
    """Rank 1 hangs in its third forward pass: rank 0's receiving thread gives up at --dist-timeout and says so
    in one line. It exited 1, the status of a bug, where a tensor-parallel group's lost peer exits 2."""
    args = ["generate", "--model", ckpt, "--input", jobs, "--json", "-n", "6", "--mode", "independent",
            "--procs", "2", "--dist-timeout", "5"]
    p = subprocess.run([sys.executable, "tests/_dist_rank_fault.py", "hang", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=200, env={**os.environ, "PYTHONPATH": str(ROOT)})
    said = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith("error: lost contact with another rank ("), p.stderr[-3000:]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("kind, launcher, rank", [("slow-load", "procs", 1), ("slow-load", "procs", 0),
                                                 ("oom-load", "procs", 1), ("oom-load", "torchrun", 1)])
def test_a_rank_that_fails_to_start_ends_the_run_in_one_line(ckpt, jobs, kind, launcher, rank):
    """A rank slower than --dist-timeout to load the model, or out of memory while loading: the exchange in which
    the ranks agree raised gloo's error, a traceback from each rank (exit 1). Now a rank out of memory is a
    refusal, said by rank 0 for it; a rank that does not come is said once, after the grace a peer has to say
    its own error (dp.lost_contact: by rank 1, naming itself, when rank 0 is the slow one); exit 2."""
    args = ["generate", "--model", ckpt, "--input", jobs, "--json", "-n", "4", "--dist-timeout", "2"]
    script = ["tests/_dist_rank_fault.py", kind, *map(str, args)]
    env = {"FAULT_RANK": str(rank)}
    if launcher == "torchrun":
        p = torchrun(2, *script, timeout=200, env=env)
    else:
        p = subprocess.run([sys.executable, *script, "--procs", "2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=200, env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    said = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    ours = p.stderr.split("distributed/elastic/")[0]  # torchrun's report of a failed rank is a traceback of its own
    assert "Traceback" not in ours and "minillama/" not in p.stderr and p.stdout == "", p.stderr[-3000:]
    if kind == "oom-load":
        assert said == ["error: rank 1: out of memory (planted: rank 1 ran out of host memory while loading)"], \
            p.stderr[-3000:]
    else:
        lost = f"error: {'rank 1: ' * (rank == 0)}lost contact with another rank while the ranks started ("
        assert len(said) == 1 and said[0].startswith(lost), p.stderr[-3000:]
        assert said[0].endswith("needs a larger one"), said
    assert p.returncode == (1 if launcher == "torchrun" else 2), p.stderr[-3000:]


def test_the_memory_warning_and_plan_are_the_largest_of_any_rank(ckpt, tmp_path):
    """Rank 1 takes the long document, whose waves are over --max-memory: one process warns and plans that; two
    ranks warned of nothing and reported rank 0's small plan (planned_memory_mb), as rank 0 planned its share."""
    path = _write_jobs(tmp_path / "jobs.jsonl", [("Paris is in France.", QUESTIONS * 2), (DOC * 8, QUESTIONS[:1])])
    args = ("--model", ckpt, "--input", path, "--json", "-n", "4", "--max-memory", "0.3")
    runs = [generate(*args), generate(*args, procs=2)]
    for p in runs:
        assert p.returncode == 0, p.stderr[-3000:]
    warned = [[line for line in p.stderr.splitlines() if line.startswith("warning: ")] for p in runs]
    planned = [json.loads(p.stderr.strip().splitlines()[-1])["planned_memory_mb"] for p in runs]
    assert len(warned[0]) == 1 and warned[1] == warned[0], warned
    assert planned[1] == planned[0] > 0.3, planned
    assert runs[1].stdout == runs[0].stdout


def test_ranks_that_read_different_input_are_refused(ckpt, jobs, tmp_path):
    """Under torchrun every rank reads the input itself. Where rank 1 read less of it (a file that changed, as
    a pipe given as /dev/stdin gave each rank a part), every rank stops before any work, one line saying what
    each read: they answered a mix of the two, some answers lost, exit 0. A pipe or a fifo is refused before
    any rank starts (it was refused only as "-")."""
    script = tmp_path / "short_rank.py"
    script.write_text("import os, runpy, sys\n"
                      "import minillama.cli as cli\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    read = cli.read_jobs\n"
                      "    cli.read_jobs = lambda *a, **k: read(*a, **k)[:-1]\n"
                      "sys.argv = ['minillama', *sys.argv[1:]]\n"
                      "runpy.run_module('minillama', run_name='__main__')\n")
    p = torchrun(2, str(script), "generate", "--model", str(ckpt), "--input", str(jobs), "--json", "-n", "2",
                 timeout=300)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and p.stdout == "", p.stderr[-3000:]  # torchrun's own status: 1
    assert errors == [f"error: the ranks read different input (rank 0: {len(DOCS)} documents, {N_QUESTIONS} "
                      f"questions; rank 1: {len(DOCS) - 1} documents, {N_QUESTIONS - len(QUESTIONS[:len(DOCS) + 1])} questions): "
                      "every rank reads the input itself, so give files that do not change while the ranks start"]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    from minillama import cli
    from minillama.errors import BadInput

    with pytest.MonkeyPatch.context() as m:
        m.setenv("WORLD_SIZE", "2")
        m.setenv("RANK", "0")
        with pytest.raises(BadInput, match="under torchrun every rank reads the input: give files, not '.*fifo'"):
            cli.check_options(cli.build_parser().parse_args(["--model", str(ckpt), "--input", str(fifo)]))
        from minillama import distributed
        from minillama.oracle.__main__ import build_parser as oracle_parser

        with pytest.raises(BadInput, match="under torchrun every rank reads the input"):  # oracle export's too
            distributed.check_options(oracle_parser().parse_args(["export", "--model", str(ckpt), "--prompt-ids",
                                                                  str(fifo), "--tp", "2", "-o", "x.safetensors"]))


@pytest.mark.parametrize("env,message", [
    ({"RANK": "1"}, "error: --doc /nonexistent: no such file"),  # a RANK left over, no torchrun: not a rank
    ({"RANK": "x", "WORLD_SIZE": "2"}, "error: RANK='x' in the environment: a rank in 0..1 of WORLD_SIZE 2"),
    ({"WORLD_SIZE": "abc"}, "error: WORLD_SIZE='abc' in the environment: a number of processes >= 1"),
    ({"WORLD_SIZE": "0"}, "error: WORLD_SIZE='0' in the environment: a number of processes >= 1"),
    # a rank outside its world, or one no launcher set, was refused without a word (only rank 0 spoke)
    ({"RANK": "5", "WORLD_SIZE": "2"}, "error: RANK='5' in the environment: a rank in 0..1 of WORLD_SIZE 2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "error: RANK='-1' in the environment: a rank in 0..1 of WORLD_SIZE 2"),
    ({"RANK": "1", "WORLD_SIZE": "2", "--procs": "2"}, "error: --procs starts its own ranks; under torchrun, leave it"),
])
def test_torchruns_variables_left_in_the_environment_are_named(ckpt, tmp_path, env, message):
    """A RANK left in a single process's environment silenced every error (only rank 0 speaks); a WORLD_SIZE
    or RANK that is no number gave a traceback, and WORLD_SIZE=0 ran as one process."""
    q = tmp_path / "q.txt"
    q.write_text("Who?\n")
    doc = "/nonexistent" if env == {"RANK": "1"} else str(tmp_path / "q.txt")
    options = [x for k, v in env.items() if k.startswith("--") for x in (k, v)]
    env = {k: v for k, v in env.items() if not k.startswith("--")}
    p = subprocess.run([sys.executable, "-m", "minillama", "generate", "--model", str(ckpt), "--doc", doc,
                        "--questions", str(q), *options], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}, "PYTHONPATH": str(ROOT),
                            **env})
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr[-2000:]
    assert p.stderr.startswith(message), p.stderr


def test_a_rank_that_cannot_join_says_so(ckpt, jobs):
    """A rank other than 0 whose rendezvous is not there (rank 0 never started, a port closed): it said
    nothing of minillama's (only rank 0 speaks, and rank 0 was not there), exit 2."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    p = subprocess.run([sys.executable, "-m", "minillama", "generate", "--model", str(ckpt), "--input", str(jobs),
                        "--dist-timeout", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2 and p.stdout == "", p.stderr[-2000:]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1: cannot join the process group: "), p.stderr[-2000:]


def test_a_killed_rank_ends_the_run_with_one_line(ckpt, tmp_path):
    """Rank 1 killed mid-run: the launcher names it, the exit is non-zero, nothing hangs, and what rank 0
    wrote before is whole lines of the one-process answers."""
    import signal
    import time

    path = tmp_path / "jobs.jsonl"
    rows = [{"doc": d * 4, "questions": QUESTIONS} for d in DOCS * 3]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["--model", ckpt, "--input", path, "--json", "-n", "40", "--ignore-eos"]
    cmd = [sys.executable, "-m", "minillama", "generate", *map(str, args), "--procs", "2"]
    # Unbuffered bytes: a buffered readline() would hold the start of the next lines, which communicate()
    # (reading the pipe itself) never sees.
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    try:
        first = proc.stdout.readline().decode()  # rank 0 has written an answer: the run is under way
        assert first, proc.stderr.read().decode()
        victim = _rank_pid(proc.pid, rank=1)
        os.kill(victim, signal.SIGKILL)
        rest, err = (b.decode() for b in proc.communicate(timeout=120))
    finally:
        proc.kill()
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1].startswith("error: rank 1 was ended by SIGKILL"), err
    written = [json.loads(line) for line in (first + rest).split("\n")[:-1]]  # whole JSON lines only
    assert written and [w["doc_index"] for w in written] == sorted(w["doc_index"] for w in written)
    time.sleep(0.5)
    assert not _children(proc.pid), "a rank outlived the run"


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _rank_pid(parent: int, rank: int) -> int:
    """--procs starts its ranks one after another (rank 0 first), so their pids ascend with the rank."""
    ranks = sorted(pid for pid in _children(parent)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())
    assert len(ranks) > rank, f"no rank {rank} among the children of {parent}"
    return ranks[rank]


def test_oracle_export_under_torchrun_with_tp(ckpt, tmp_path):
    """`oracle export` on two tensor-parallel ranks writes the record of one process with the same units."""
    from safetensors.torch import load_file

    def export(out, *extra, nproc=0):
        args = ["-m", "minillama", "oracle", "export", "--model", str(ckpt), "-n", "4", "--hidden",
                "-o", str(out), *extra]
        if nproc:
            return torchrun(nproc, *args)
        return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=400,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})

    for p in (export(tmp_path / "one.safetensors", "--units", "4"), export(tmp_path / "tp.safetensors", "--tp", "2",
                                                                         nproc=2)):
        assert p.returncode == 0, p.stderr[-3000:]
    one, tp = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "tp.safetensors")
    assert one.keys() == tp.keys() and any(k.endswith(".hidden") for k in one)
    assert all(torch.equal(one[k], tp[k]) for k in one)
    manifest = json.loads((tmp_path / "tp.json").read_text())
    assert (manifest["tp"], manifest["units"], manifest["ranks"]) == (2, 4, 2)


def test_shape_bench_runs_tensor_parallel_under_torchrun(tmp_path):
    """`bench --shape ... --tp 2` (the command for a GPU machine) on two CPU ranks: rank 0 reports, the
    sharded parallel run gives the tokens of the sharded independent run."""
    p = torchrun(2, "-m", "minillama", "bench", "--shape", "tiny", "--tiny", "--tp", "2", "--repeats", "1",
                 "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    data = json.loads((tmp_path / "shape_results.json").read_text())
    assert data["meta"]["tp"] == 2
    rec = {r["method"]: r for r in data["records"]}
    assert rec["independent"]["same_tokens_as_parallel"] == rec["independent"]["questions_run"]


@pytest.mark.slow
def test_distributed_bench_quick(tmp_path):
    """The distributed bench's smoke run: two ranks answer the same bytes as one; tensor-parallel memory per
    rank is 1/tp of the sharded weights plus the replicated ones, and a rank sends nothing at tp=1."""
    p = subprocess.run([sys.executable, "-m", "minillama.bench.distributed", "--quick", "--repeats", "1",
                        "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "distributed.json").read_text())
    assert r["data_parallel"]["same_bytes"] and r["data_parallel"]["answers"] == 4
    rows = {t["tp"]: t for t in r["tensor_parallel"]}
    assert set(rows) == {1, 2} and rows[1]["bytes_sent_per_decode_step"] == 0 < rows[2]["bytes_sent_per_decode_step"]
    for t in rows.values():
        assert t["sharded_bytes_per_rank"] * t["tp"] == t["sharded_bytes_one_process"]
        assert t["replicated_bytes_per_rank"] == t["replicated_bytes"]
    assert rows[2]["kv_bytes_per_token_per_rank"] * 2 == rows[1]["kv_bytes_per_token_per_rank"]


@pytest.mark.parametrize("args, says", [(["--ranks", "0"], "--ranks must be at least 1, got 0"),
                                        (["--repeats", "0"], "--repeats must be at least 1, got 0"),
                                        (["--out", "README.md"], "README.md: exists and is not a folder")])
def test_the_distributed_bench_refuses_in_one_line_before_it_runs(args, says):
    """Each was a traceback (a ZeroDivisionError, a StatisticsError, or the output's, after the runs)."""
    p = subprocess.run([sys.executable, "-m", "minillama.bench.distributed", "--quick", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and p.stderr.splitlines() == [f"error: {says}"], p.stderr[-2000:]


def test_the_distributed_bench_takes_a_model_path_relative_to_where_it_is_run(ckpt, tmp_path):
    """The runs start in the repository: a relative --model was looked for there ("no such file")."""
    p = subprocess.run([sys.executable, "-m", "minillama.bench.distributed", "--quick", "--repeats", "1", "-m",
                        os.path.relpath(ckpt, tmp_path), "--out", "out"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "distributed.json").read_text())["data_parallel"]["same_bytes"]


@pytest.mark.parametrize("local_rank", [None, "3"])
def test_a_rank_probes_its_own_gpu(local_rank, monkeypatch):
    """`--device cuda` under torchrun is checked on the rank's own GPU (cuda:LOCAL_RANK, the one it will
    use), not on the current device: otherwise every rank opens a context on GPU 0. Recorded on a CPU by
    standing in for the allocation the check makes."""
    from minillama.errors import check_device

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    probed, zeros = [], torch.zeros

    def record(*shape, device=None, **kw):
        probed.append(torch.device(device))
        return zeros(*shape, **kw)

    monkeypatch.setattr(torch, "zeros", record)
    check_device("cuda")
    assert probed == [torch.device("cuda") if local_rank is None else torch.device("cuda", 3)]


# --- data parallel on ordinary input: idle ranks, split questions, refusals, closed pipes, bounds ------------


@pytest.mark.parametrize("device, procs, local, refused", [("cuda:0", 2, None, True), ("cuda:1", 1, "2", True),
                                                          ("cuda", 2, None, False), ("cuda", 1, "2", False),
                                                          ("cuda:1", 1, "1", False), ("cpu", 1, "2", False)])
def test_a_gpu_named_by_its_index_is_refused_with_more_than_one_rank_on_a_machine(monkeypatch, device, procs, local,
                                                                                  refused):
    """--device cuda:0 under --procs 2 or torchrun's two local ranks: `join` gives each rank the GPU of its local
    rank only for --device cuda, so every rank took GPU 0. Refused in one line before any rank starts (under
    torchrun, before any joins); one rank a machine may name its GPU. Checked without a GPU."""
    from argparse import Namespace

    from minillama import distributed
    from minillama.errors import BadInput

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if local is not None:  # as torchrun sets them for rank 0 of its LOCAL_WORLD_SIZE here, of 2 in all
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    args = Namespace(procs=procs, tp=1, units=None, dist_timeout=600, doc=None, questions=None, input="in.jsonl",
                     prompt_ids=None, device=device, model=None)
    if not refused:
        distributed.check_options(args)
        return
    with pytest.raises(BadInput, match=rf"^--device {device} with 2 ranks on this machine: every rank would take "
                                       rf"GPU {device[-1]}; give --device cuda, and each rank takes the GPU of its"):
        distributed.check_options(args)


def test_questions_are_split_so_that_one_long_document_gains():
    """One document with 1,000 questions over two groups: half the questions each (each group prefills the
    document once); seqbatch keeps documents whole; a group past the last question has nothing to do."""
    from minillama.distributed.dp import share_questions

    halves = share_questions([2000], [[30] * 1000], 2)
    assert halves == [[(0, 0, 500)], [(0, 500, 1000)]]
    assert share_questions([50, 50], [[10] * 3, [10] * 3], 2, whole_documents=True) == [[(0, 0, 3)], [(1, 0, 3)]]
    assert share_questions([50], [[10]], 3) == [[(0, 0, 1)], [], []]
    # every question in exactly one piece, in input order
    pieces = [p for share in share_questions([5, 900, 7], [[3] * 4, [50] * 9, [1] * 30], 3) for p in share]
    assert [(d, q) for d, lo, hi in pieces for q in range(lo, hi)] == \
        [(d, q) for d, n in enumerate((4, 9, 30)) for q in range(n)]


def _write_jobs(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps({"doc": d, "questions": q}) + "\n" for d, q in rows))
    return path


@pytest.mark.parametrize("rows", [[(DOC, QUESTIONS[:1])], [(DOC, QUESTIONS * 3)], [(DOCS[1], QUESTIONS[:1])] * 2])
def test_idle_ranks_and_a_split_document_write_one_process_bytes(ckpt, tmp_path, rows):
    """One document and one question over two ranks (rank 1 has nothing to do: it used to fail on an empty
    share), one document's 12 sampled questions split between two ranks, and two one-question documents:
    the bytes of one process."""
    jobs = _write_jobs(tmp_path / "jobs.jsonl", rows)
    one = generate(*common(ckpt, jobs))
    two = generate(*common(ckpt, jobs), procs=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and one.stdout.count("\n") == sum(len(q) for _, q in rows)
    if len(rows[0][1]) > 1:  # both groups answered: each prefilled the document once
        s1, s2 = (json.loads(p.stderr.strip().splitlines()[-1]) for p in (one, two))
        assert s2["prompt_tokens"] > s1["prompt_tokens"]


def test_a_rank_on_another_node_that_refuses_its_input_says_so_and_all_stop_at_once(ckpt, jobs, tmp_path):
    """Two torchrun nodes over loopback; node 1's rank cannot read its input. Its node says why in one line,
    rank 0's node says which rank and why, and both end in seconds, not at --dist-timeout."""
    import time

    from minillama.distributed.launch import free_port

    port = free_port()
    missing = tmp_path / "missing.jsonl"
    cmd = lambda node, path: [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
                              "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                              "--rdzv-id=minillama-refuse", "-m", "minillama", "generate",
                              *map(str, common(ckpt, path, "--dist-timeout", "120"))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    nodes = [subprocess.Popen(cmd(n, path), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for n, path in ((0, jobs), (1, missing))]
    try:
        outs = [n.communicate(timeout=300) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    elapsed = time.monotonic() - t0
    said = f"rank 1: --input {missing}: no such file"
    for (out, err), node in zip(outs, nodes):
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert node.returncode != 0 and out == "", err[-2000:]
        assert errors == [f"error: {said}"], err[-3000:]  # once per machine, naming the rank
        assert "/minillama/" not in err, err[-3000:]  # no traceback of ours (torchrun prints its own report)
    assert elapsed < 90, f"the ranks waited {elapsed:.0f} s"


def test_a_template_every_rank_refuses_is_one_line(ckpt, jobs, tmp_path):
    """Every rank (--procs 2) meets the same refusal (a Mistral-style template refusing --system): one line,
    once, exit 2, nothing written (each rank used to end in a TemplateError traceback)."""
    from test_faults import MISTRAL_V01

    d = tmp_path / "ckpt"
    d.mkdir()
    for f in ckpt.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": MISTRAL_V01}))
    p = generate("--model", d, "--input", jobs, "--system", "Be brief.", procs=2)
    assert p.returncode == 2 and p.stdout == "", p.stderr[-3000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "Conversation roles must alternate" in p.stderr, p.stderr


def _two_rank_workload(tmp_path: Path) -> Path:
    """Answers enough for well over a pipe's 64 KiB of buffer (with -n 40 --logprobs), from both ranks."""
    return _write_jobs(tmp_path / "jobs.jsonl", [(DOC, QUESTIONS[:1]), (DOCS[1] * 3, QUESTIONS * 16)])


def test_a_reader_that_goes_away_ends_the_ranks_quietly(ckpt, tmp_path):
    """`--procs 2 ... | head -1`: the answers rank 0 writes for rank 1 (its receiving thread) meet the closed
    pipe; the run ends quietly through the one error runner, no traceback from any thread or rank."""
    args = ["--model", ckpt, "--input", _two_rank_workload(tmp_path), "--json", "--logprobs", "-n", "40",
            "--ignore-eos"]
    proc = subprocess.Popen([sys.executable, "-m", "minillama", "generate", *map(str, args), "--procs", "2"],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, bufsize=0)
    try:
        first = proc.stdout.readline()
        proc.stdout.close()  # as `head -1` does
        err = proc.stderr.read().decode()
        proc.wait(timeout=300)
    finally:
        proc.kill()
    assert first and proc.returncode == 141, err[-3000:]
    assert err == "", err[-3000:]


def test_answers_to_a_full_disk_from_two_ranks_are_one_line_and_no_summary(ckpt, tmp_path):
    from _faults import run_tool

    with open(tmp_path / "out.jsonl", "w") as out:
        p = run_tool("generate", "--model", ckpt, "--input", _two_rank_workload(tmp_path), "--json", "-n", "12",
                     "--ignore-eos", "--procs", "2", limit_file_bytes=600, stdout=out, stderr=subprocess.PIPE)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "File too large" in lines[0], p.stderr[-3000:]


@pytest.mark.parametrize("procs", ["99999999999999999999", "1000"])
def test_more_ranks_than_the_machine_can_run_are_one_line(ckpt, jobs, procs):
    p = generate("--model", ckpt, "--input", jobs, "--procs", procs)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [p.stderr.strip()] and f"--procs {procs}: more than 2 ranks for each" \
        in p.stderr or "MiB are available" in p.stderr, p.stderr


def test_the_bound_on_ranks_is_the_cpus_this_process_may_use_and_the_memory(monkeypatch):
    from argparse import Namespace

    from minillama.distributed import launch
    from minillama.errors import BadInput

    monkeypatch.setattr(launch, "usable_cpus", lambda: 2)
    monkeypatch.setattr(launch, "available_memory", lambda: 10 * launch.RANK_MEMORY)
    for procs in (2, 3, 4):
        launch.check_procs(Namespace(procs=procs, tp=1, device="cpu"))
    with pytest.raises(BadInput, match=r"--procs 5: more than 2 ranks for each of the 2 CPUs .*\(at most --procs 4\)"):
        launch.check_procs(Namespace(procs=5, tp=1, device="cpu"))
    monkeypatch.setattr(launch, "usable_cpus", lambda: 64)
    with pytest.raises(BadInput, match=r"--procs 11: each rank needs at least 256 MiB .*\(at most --procs 10\)"):
        launch.check_procs(Namespace(procs=11, tp=1, device="cpu"))


@pytest.mark.parametrize("fault", ["pipe", "full"])
def test_the_answer_writing_thread_ends_through_the_one_error_runner(fault):
    """Rank 0's receiving thread writes rank 1's answer into a closed pipe or a full disk: the process ends
    with the one runner's status (141 quietly; 2 with one line), no thread traceback, no summary after it."""
    p = torchrun(2, "tests/_dist_writer_fault.py", fault, timeout=200)
    ours = [line for line in p.stderr.splitlines() if "torch.distributed.elastic" not in line]
    assert "Exception in thread" not in p.stderr and "summary" not in p.stderr, p.stderr[-3000:]
    assert "exitcode  : " + ("141" if fault == "pipe" else "2") in p.stderr, p.stderr[-3000:]
    errors = [line for line in ours if line.startswith("error: ")]
    assert errors == ([] if fault == "pipe" else ["error: cannot write the output (No space left on device)"]), \
        p.stderr[-3000:]


def test_sigterm_to_the_launcher_ends_its_ranks(ckpt, jobs):
    """SIGTERM (as `timeout` or a scheduler sends it) to `--procs`'s launcher left its ranks running, orphaned,
    until they finished or --dist-timeout ended them; it now ends them as Ctrl-C does: exit 143, one line."""
    cmd = [sys.executable, "-m", "minillama", "generate", *map(str, common(ckpt, jobs)), "--procs", "2"]
    launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})

    def children() -> set[int]:
        found = set()
        for task in Path(f"/proc/{launcher.pid}/task").glob("*/children"):
            found |= {int(c) for c in task.read_text().split()}
        return found

    deadline = time.monotonic() + 120
    while len(ranks := children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ranks) >= 2, "the ranks never started"
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(60)
    time.sleep(1)
    alive = [p for p in ranks if Path(f"/proc/{p}").exists()
             and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"]  # a zombie has ended
    for p in alive:  # leave nothing behind, whatever the verdict
        os.kill(p, signal.SIGKILL)
    assert not alive, f"ranks {alive} outlived their launcher"
    assert code == 128 + signal.SIGTERM and launcher.stderr.read().strip().splitlines()[-1] == "terminated"


def test_an_mlp_of_fewer_features_than_units_gives_one_process_bytes_at_every_degree(tmp_path, jobs):
    """intermediate_size 3 at 4 KV heads (the default units): one unit of the MLP holds no feature. One process
    raised oneDNN's RuntimeError (a traceback), and under --tp 4 that rank's report deadlocked against its peers'
    collective until --dist-timeout. An empty unit's product is now an empty sum (zeros)."""
    tok = tiny_tokenizer()
    config = tiny_config(layers=1, heads=4, kv_heads=4, head_dim=6, vocab=tok.vocab_size, max_pos=512)
    config.intermediate_size = 3
    ckpt = save_hf_dir(config, tiny_model(config, seed=1).state_dict(), tok, tmp_path / "narrow")
    alone = generate(*common(ckpt, jobs))
    assert alone.returncode == 0 and alone.stdout.count("\n") == N_QUESTIONS, alone.stderr
    ranks = generate(*common(ckpt, jobs, "--tp", "4", "--dist-timeout", "60"), procs=4)
    assert (ranks.returncode, ranks.stdout) == (0, alone.stdout), ranks.stderr[-2000:]


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGINT", "SIGINT ignored"])
def test_a_signal_while_the_ranks_start_ends_them_too(sent):
    """The launcher took SIGTERM only once every rank had started: one sent while they started killed the launcher
    alone (exit -15, CI saw it once), and a SIGINT (Ctrl-C, or `kill -INT` to the launcher alone) then raised
    before any started rank was ended. Both are now taken from before the first starts and acted on once all have:
    the ranks ended, exit 143 or 130 and one line. A SIGINT the launcher was started ignoring (`&` in a script)
    stays ignored: the ranks run on."""
    signum, ignored = sent.split()[0], sent.endswith("ignored")
    handler = "SIG_IGN" if ignored else "default_int_handler"
    script = textwrap.dedent(f"""
        import os, signal, types
        import torch.multiprocessing as mp
        from minillama.distributed import launch

        signal.signal(signal.SIGINT, signal.{handler})  # as whoever started this left it
        ended = []

        class Rank:
            def is_alive(self):
                return True

            def terminate(self):
                ended.append(1)

        def start(*args, **kwargs):
            os.kill(os.getpid(), signal.{signum})  # as if sent between the first rank's start and the last's
            return types.SimpleNamespace(processes=[Rank(), Rank()], join=lambda: True)

        mp.start_processes = start
        args = types.SimpleNamespace(procs=2)
        print(launch.run(args, [], None), len(ended), signal.getsignal(signal.SIGINT) == signal.{handler})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    if ignored:
        assert (proc.returncode, proc.stdout.split(), proc.stderr) == (0, ["0", "0", "True"], ""), proc.stderr[-2000:]
        return
    status = 130 if signum == "SIGINT" else 143
    assert (proc.returncode, proc.stdout.split()) == (0, [str(status), "2", "True"]), proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == ("interrupted" if signum == "SIGINT" else "terminated")
