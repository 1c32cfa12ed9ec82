"""Where the time goes: torch.profiler with minillama's functions marked."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput
from ..files import json_text, write_file
from .methods import Context
from .runner import RUNNERS
from .task import Task, TaskConfig, make_task, plain_prompt_ids


# Functions looked up by name at call time in these modules, so wrapping the module attribute marks them.
_MARKED = {"step": ("plan_attention",), "model": ("blocked_attention", "masked_attention", "apply_rope_folded"),
           "invariant": ("tiled_linear",),
           "generate": ("_decode",)}


def profile_breakdown(ctx: Context, task: Task, mode: str = "parallel", invariant: bool = True,
                      idx: list[int] | None = None) -> dict[str, Any]:
    """Run one method under torch.profiler and split its CPU time by phase (prefill / decode), by
    minillama function (attention planning, blocked attention, linear layers, RoPE, the rest) and, inside
    attention, by aten op (gather = index, bmm, elementwise, scatter = index_put/scatter_reduce, ...).

    Self CPU time of each aten op is charged to the innermost marked function around it; ops outside any
    marked function count as "other" (norms, embedding, sampling, glue). Shares, not absolute times, are
    what to read: the profiler adds ~10 us per op.
    """
    import importlib

    from torch.profiler import ProfilerActivity, profile, record_function

    saved: list[tuple[Any, str, Any]] = []

    def mark(mod: Any, name: str) -> None:
        fn = getattr(mod, name)

        def marked(*a: Any, **k: Any) -> Any:
            with record_function(f"ml::{name}"):
                return fn(*a, **k)
        saved.append((mod, name, fn))
        setattr(mod, name, marked)

    idx = list(range(task.n)) if idx is None else idx
    runner = RUNNERS[{("independent", True): "independent", ("independent", False): "independent_plain",
                      ("parallel", False): "parallel_plain"}.get((mode, invariant), mode)]
    try:
        for mod_name, names in _MARKED.items():
            mod = importlib.import_module(f"minillama.{mod_name}")
            for name in names:
                mark(mod, name)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            res = runner(ctx, task, idx)
            wall = time.perf_counter() - t0
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)

    by_fn: dict[tuple[str, str], float] = {}
    attn_ops: dict[str, float] = {}
    events = prof.events()
    for ev in events:
        # A marked range's own self time is the Python between its ops (e.g. planning's loops).
        own = ev.name[4:] if ev.name.startswith("ml::") and ev.name != "ml::_decode" else None
        phase, fn, p = "prefill", own or "other", ev
        while p is not None:
            if p.name == "ml::_decode":
                phase = "decode"
            elif p is not ev and p.name.startswith("ml::") and fn == "other":
                fn = p.name[4:]
            p = p.cpu_parent
        t = ev.self_cpu_time_total / 1e6
        by_fn[(phase, fn)] = by_fn.get((phase, fn), 0.0) + t
        if fn in ("blocked_attention", "masked_attention"):
            op = _OP_KIND.get(ev.name, ev.name.removeprefix("aten::"))
            attn_ops[f"{phase}:{op}"] = attn_ops.get(f"{phase}:{op}", 0.0) + t
    total = sum(by_fn.values())
    return {"mode": mode, "invariant": invariant, "questions": len(idx), "wall_s": wall,
            "prefill_s": res.prefill_s, "decode_s": res.decode_s, "profiled_cpu_s": total,
            "by_function": {f"{ph}:{fn}": v for (ph, fn), v in sorted(by_fn.items(), key=lambda x: -x[1])},
            "attention_ops": dict(sorted(attn_ops.items(), key=lambda x: -x[1]))}


_OP_KIND = {"aten::index": "gather (index)", "aten::index_select": "gather (index)", "aten::bmm": "bmm",
            "aten::index_put_": "scatter (index_put)", "aten::_index_put_impl_": "scatter (index_put)",
            "aten::scatter_reduce_": "row max (scatter_reduce)", "aten::exp_": "exp", "aten::exp": "exp",
            "aten::sub_": "sub", "aten::add": "tree merge (add)", "aten::copy_": "copy", "aten::fill_": "fill",
            "aten::zero_": "fill", "aten::amax": "amax", "aten::sum": "sum", "aten::masked_fill_": "mask",
            "aten::where": "where", "aten::div": "div", "aten::cat": "cat", "aten::mul": "mul",
            "aten::index_add_": "block sums (index_add)"}


def profile_table(p: dict[str, Any]) -> str:
    tot = p["profiled_cpu_s"]
    lines = [f"{p['mode']} (invariant={p['invariant']}), {p['questions']} questions: wall {p['wall_s']:.1f} s "
             f"(prefill {p['prefill_s']:.1f} s, decode {p['decode_s']:.1f} s), profiled op time {tot:.1f} s", "",
             "| phase:function | s | share |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |" for k, v in p["by_function"].items() if v / tot > 0.002]
    lines += ["", "| phase:attention op | s | share of all |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |" for k, v in p["attention_ops"].items() if v / tot > 0.002]
    return "\n".join(lines)



def _profile_main(ctx: Context, out: Path, doc_tokens: int, questions: int, model_name: str,
                  new_tokens: int = 8) -> int:
    context = ctx.model.config.context
    if doc_tokens >= context:  # before a document of that many tokens is written (1e20: it never ended)
        raise BadInput(f"--doc-tokens {doc_tokens}: the model's context is {context} tokens")
    # Numbered questions: every one distinct, as in the many-questions sweep.
    task = make_task(ctx.tokenizer, TaskConfig(doc_tokens=doc_tokens, questions_per_doc=questions,
                                               new_tokens=new_tokens, numbered=True),
                     plain_prompt_ids(ctx.tokenizer))
    longest = max(len(p) for p in task.prompts)
    if longest >= context:  # the document with a question and the prompt's own text
        raise BadInput(f"--doc-tokens {doc_tokens}: a prompt of {longest} tokens with its question, the model's "
                       f"context is {context}")
    runs = {}
    for mode, inv, idx in (("parallel", True, None), ("parallel", False, None), ("independent", True, [0]),
                           ("independent", False, [0])):
        p = profile_breakdown(ctx, task, mode, inv, idx)
        runs[f"{mode}{'' if inv else '_plain'}"] = p
        print(profile_table(p) + "\n", flush=True)
    write_file(out / "profile.json", json_text(runs, indent=1) + "\n")
    head = f"# Profile: {model_name}, doc {doc_tokens} tokens, {questions} questions, {new_tokens} new tokens, " \
           f"{torch.get_num_threads()} threads\n"
    write_file(out / "profile.md", head + "\n" + "\n\n".join(profile_table(p) for p in runs.values()) + "\n")
    print(f"wrote {out / 'profile.md'}, {out / 'profile.json'}")
    return 0
