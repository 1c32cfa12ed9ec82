"""Parallel against independent, every step's logits, on random weights at a named shape, on any device.

The check a new device, dtype or torch version needs before its speed means anything: questions of varied
lengths about one document, answered once packed together and once each alone, greedy and sampled, with
the invariant kernels and with the plain ones (the negative control). Each step's logits row is compared
with `torch.equal`; the report counts the steps that differ and the questions whose tokens changed.

    python -m minillama.bench --shape llama3-8b --device cuda --dtype bfloat16 --parity
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..generate import SamplingParams, generate


def workload(vocab: int, doc_tokens: int, questions: int, lengths: tuple[int, int],
             seed: int = 1) -> list[list[int]]:
    """One random document and `questions` random questions of lengths[0] .. lengths[1] tokens after it."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, vocab, (doc_tokens,), generator=g).tolist()
    lo, hi = lengths
    return [doc + torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(questions)]


def compare(model: Any, prompts: list[list[int]], new_tokens: int, sampled: bool, invariant: bool,
            compiled: bool = False) -> dict[str, Any]:
    """One comparison: how many of the questions' steps have other logits bits, packed against alone;
    `compiled`: both runs' steps through torch.compile (step.py). The questions alone decode each step before
    the next is laid out; packed, the model's default (on a GPU, one step ahead of the host: generate._decode)."""
    params = SamplingParams(max_new_tokens=new_tokens, keep_logits=True, ignore_eos=True,
                            temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0, seed=7)
    saved = model.invariant, model.steps.compiled, model.steps.overlap
    model.invariant, model.steps.compiled, model.steps.overlap = invariant, compiled, False
    try:
        alone = generate(model, prompts, params, mode="independent")
        model.steps.overlap = saved[2]
        packed = generate(model, prompts, params, mode="parallel")
    finally:
        model.invariant, model.steps.compiled, model.steps.overlap = saved
    kernels = ("invariant" if invariant else "plain") + (", compiled" if compiled else "") + \
        (f", units {model.units}" if model.units != 1 else "")
    return {"sampled": sampled, "kernels": kernels, **differing(alone, packed)}


def differing(expected: list[Any], got: list[Any]) -> dict[str, Any]:
    """Two runs' answers (with every step's logits kept) side by side: the steps whose logits have other bits
    (`torch.equal`), the largest difference, and the questions whose tokens changed."""
    pairs = [(x, y) for a, b in zip(expected, got) for x, y in zip(a.logits, b.logits)]
    return {"questions": len(expected), "steps": len(pairs),
            "steps_differing": sum(not torch.equal(x, y) for x, y in pairs),
            "max_abs_diff": max((float((x.float() - y.float()).abs().max()) for x, y in pairs), default=0.0),
            "questions_with_other_tokens": sum(a.token_ids != b.token_ids for a, b in zip(expected, got))}


def compare_captured(model: Any, prompts: list[list[int]], new_tokens: int, sampled: bool,
                     compiled: bool = False) -> dict[str, Any]:
    """Captured steps against eager ones (step.py), the parallel run's every step's logits: 0 steps may differ;
    `compiled`: both runs' steps through torch.compile."""
    params = SamplingParams(max_new_tokens=new_tokens, keep_logits=True, ignore_eos=True,
                            temperature=0.8 if sampled else 0.0, top_p=0.9 if sampled else 1.0, seed=7)
    saved = model.steps.captured, model.steps.compiled
    try:
        model.steps.captured, model.steps.compiled = False, compiled
        eager = generate(model, prompts, params, mode="parallel")
        model.steps.captured = True
        captured = generate(model, prompts, params, mode="parallel")
    finally:
        model.steps.captured, model.steps.compiled = saved
    kernels = "captured vs eager" + (", compiled" if compiled else "")
    return {"sampled": sampled, "kernels": kernels, **differing(eager, captured)}


def parity(model: Any, doc_tokens: int = 554, questions: int = 16, lengths: tuple[int, int] = (6, 20),
           new_tokens: int = 8, log: Callable[[str], None] = print, compiled: bool = False,
           controls: bool = True) -> list[dict[str, Any]]:
    """Greedy and sampled, invariant and plain kernels: four comparisons on one workload (and on CUDA captured
    steps against eager ones); `compiled`: the invariant ones again with compiled steps; `controls` False: the
    invariant kernels alone (a model whose controls another call ran: the same weights at other units)."""
    prompts = workload(model.config.vocab_size, doc_tokens, questions, lengths)
    kernels = [(True, False)] + ([(False, False)] if controls else []) + \
        ([(True, True)] if compiled else [])  # (invariant, compiled)
    # where steps are captured (CUDA): captured against eager too, with each compile setting
    captured = ([False, True] if compiled else [False]) if model.device.type == "cuda" and controls else []
    records = []
    for sampled in (False, True):
        for invariant, compile_ in kernels:
            r = compare(model, prompts, new_tokens, sampled, invariant, compile_)
            log(f"  parity, {'sampled' if sampled else 'greedy'}, {r['kernels']} kernels: "
                f"{r['steps_differing']} of {r['steps']} steps differ")
            records.append(r)
        for compile_ in captured:
            r = compare_captured(model, prompts, new_tokens, sampled, compile_)
            log(f"  {r['kernels']}, {'sampled' if sampled else 'greedy'}: "
                f"{r['steps_differing']} of {r['steps']} steps differ")
            records.append(r)
    return records


def parity_table(records: list[dict[str, Any]]) -> str:
    lines = ["| decoding | kernels | steps differing (torch.equal) | max abs diff | questions with other tokens |",
             "|---|---|---|---|---|"]
    lines += [f"| {'sampled' if r['sampled'] else 'greedy'} | {r['kernels']} | {r['steps_differing']} of {r['steps']} | "
              f"{r['max_abs_diff']:.3g} | {r['questions_with_other_tokens']} of {r['questions']} |" for r in records]
    return "\n".join(lines)
