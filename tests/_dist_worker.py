"""One rank of the tensor-parallel checks in tests/test_distributed.py, started by torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/_dist_worker.py OUT --tp T [--plain]
    ... tests/_dist_worker.py OUT --tp T --load CHECKPOINT [--whole]     (memory of a sharded load)
    ... tests/_dist_worker.py OUT --tp T --diverge                        (a planted token divergence)

Every rank builds the same tiny model (8 KV heads, biases, a sliding window), sets `units = 8`, shards it over its tensor-parallel group
and then (a) runs the parity property (parallel == independent, every step's logits torch.equal) on random
layouts drawn by hypothesis, derandomized so that every rank draws the same examples, in float32 and bfloat16;
(b) answers one fixed workload and (c) checks prefill == decode. Rank 0 saves what it found to OUT for the
parent test, which compares the fixed workload's logits across degrees. --plain swaps the fixed combine for a
plain all_reduce (the negative control).

--load: each rank loads CHECKPOINT as `minillama generate --tp T` does (only its parts read) and reports its
peak resident memory over the load, from a peak reset just before (/proc/self/clear_refs); --whole loads the
whole checkpoint and then shards it (the old way, the negative control). Then every rank checks that its parts
equal, in value and strides, those of the whole model sharded.
--diverge: rank 1 samples with another seed; the run must stop on the first step, in one line, on every rank.
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock
from pathlib import Path

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from minillama import invariant  # noqa: E402
from minillama.audit import ProductSignatures  # noqa: E402
from minillama.distributed import tp as tensor_parallel  # noqa: E402
from minillama.distributed import world as worlds  # noqa: E402
from minillama.generate import SamplingParams, generate  # noqa: E402
from tiny import SMALL_TILES, VOCAB, ids, tiny_config, tiny_model  # noqa: E402

KV_HEADS = 8
# biases on every projection (a column split's shard with its features, a row split's added after the sum) and
# a sliding window shorter than the prompts
CONFIG = dict(layers=2, heads=16, kv_heads=KV_HEADS, head_dim=8, tied=False, attention_bias=True, mlp_bias=True,
              window=40)


def build(dtype: torch.dtype, seed: int = 0, group=None, plain: bool = False):
    model = tiny_model(tiny_config(**CONFIG), seed, dtype, SMALL_TILES)
    model.units = KV_HEADS
    if group is not None:
        tensor_parallel.shard_(model, group, plain_all_reduce=plain)
    return model


def fixed_workload() -> tuple[list[list[int]], SamplingParams]:
    g = torch.Generator().manual_seed(7)
    doc = torch.randint(3, VOCAB, (90,), generator=g).tolist()
    prompts = [doc + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 23, 1, 40)]
    return prompts, SamplingParams(max_new_tokens=5, keep_logits=True, ignore_eos=True)


def answers_of(model) -> list[list[torch.Tensor]]:
    prompts, params = fixed_workload()
    return [a.logits for a in generate(model, prompts, params, mode="parallel")]


def product_signatures(model) -> set[tuple]:
    """Every matrix product's signature (op, shapes, strides, dtype, alignment) while answering the workload,
    each column-split projection's units issued as their own products, as a GPU issues them: a CPU's one
    product over its units (`proofs.proven_units`) is a proven form of those, which the logits check for bits."""
    with mock.patch.object(invariant, "proven_units", lambda *a: False), ProductSignatures() as seen:
        answers_of(model)
    return seen.signatures


def prefill_equals_decode(model) -> bool:
    """A token's logits when generated equal its logits in one teacher-forced pass over prompt + answer."""
    prompts, params = fixed_workload()
    for p, a in zip(prompts, generate(model, prompts, params, mode="independent")):
        forced = model(torch.tensor(p + a.token_ids[:-1]))[len(p) - 1:]
        if not all(torch.equal(x, y) for x, y in zip(a.logits, forced, strict=True)):
            return False
    return True


def parity_property(group, dtype: torch.dtype, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 1000), data=st.data())
    def check(seed, data):
        model = build(dtype, seed, group)
        doc = ids(data.draw, 0, 120)
        prompts = [doc + ids(data.draw, 1, 30) for _ in range(data.draw(st.integers(1, 6)))]
        sampled = data.draw(st.booleans())
        params = SamplingParams(max_new_tokens=data.draw(st.integers(1, 4)), keep_logits=True,
                                temperature=0.8 if sampled else 0.0, seed=data.draw(st.integers(0, 99)))
        layout = dict(prefill_chunk=data.draw(st.sampled_from([7, 64, 512])),
                      parallel_size=data.draw(st.sampled_from([None, 2])))
        alone = generate(model, prompts, params, mode="independent")
        packed = generate(model, prompts, params, mode="parallel", **layout)
        for a, b in zip(alone, packed, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
            assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))

    check()


def memory_kib(field: str) -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field + ":"))


def load(world, path: str, whole: bool) -> dict:
    """Peak resident memory over one load of `path` at this rank's degree, and whether the parts are right."""
    import argparse as ap

    from minillama.distributed import parallel
    from minillama.weights import load_model

    from minillama.model import Llama
    from minillama.weights import read_config

    args = ap.Namespace(tp=world.tp, units=None, device="cpu")
    here = parallel.Here(world)
    with torch.device("meta"):  # torch's one-time set-up of a model skeleton (~70 MiB, whatever the model) is
        Llama(read_config(path))  # the process's, not the weights': paid before the peak is reset
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
    before = memory_kib("VmRSS")
    model, _ = load_model(path, shard=None if whole else parallel.sharding(args, here))
    parallel.place(model, args, here)
    peak = memory_kib("VmHWM") - before
    reference, _ = load_model(path)
    parallel.place(reference, args, here)
    mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    same = mine.keys() == theirs.keys() and all(
        torch.equal(mine[k], theirs[k]) and mine[k].stride() == theirs[k].stride() for k in mine)
    return {"peak_kib": peak, "same_parts": same}


def diverge(world) -> int:
    """Sampled answers, rank 1 with another seed: the ranks' first tokens differ."""
    from minillama.errors import run_command

    model = build(torch.float32, group=world.tp_group)
    prompts, _ = fixed_workload()
    params = SamplingParams(max_new_tokens=5, temperature=1.0, ignore_eos=True, seed=5 + (world.rank == 1))
    return run_command(lambda: len(generate(model, prompts, params, mode="parallel")) and 0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--examples", type=int, default=10)
    p.add_argument("--plain", action="store_true")
    p.add_argument("--load")
    p.add_argument("--whole", action="store_true")
    p.add_argument("--diverge", action="store_true")
    args = p.parse_args()
    world = worlds.init(args.tp, torch.device("cpu"), timeout_s=120)
    if args.diverge:
        sys.exit(diverge(world))
    if args.load:
        mine = load(world, args.load, args.whole)
        every = [None] * world.size
        dist.all_gather_object(every, mine)
        if world.rank == 0:
            torch.save(every, args.out)
        worlds.finish()
        return
    results = {"world": world.size, "tp": world.tp}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(dtype, group=world.tp_group, plain=args.plain)
        results[f"logits_{dtype}"] = answers_of(model)
        results[f"prefill_equals_decode_{dtype}"] = prefill_equals_decode(model)
        results[f"bytes_{dtype}"] = model.kernels.comm.bytes_moved
        results[f"signatures_{dtype}"] = product_signatures(model)
        if not args.plain:
            parity_property(world.tp_group, dtype, args.examples)
            results[f"parity_{dtype}"] = args.examples
    # every rank of a group holds the same answers: check it, then rank 0 reports
    mine = torch.cat([x.float().reshape(-1) for q in results["logits_torch.float32"] for x in q])
    every = [torch.empty_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine)
    results["ranks_agree"] = all(torch.equal(every[0], e) for e in every)
    if world.rank == 0:
        torch.save(results, args.out)
    worlds.finish()


if __name__ == "__main__":
    main()
