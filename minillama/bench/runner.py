"""One sweep point: a task, several methods, round-robin repeats, medians; and the setup of a run."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..config import LlamaConfig
from ..generate import shared_prefix_length
from .cost import CostModel, flop_rates, gemm_rate
from .hf import hf_batched, hf_prefix
from .llamacpp import chunks, llamacpp
from .methods import ADDITIVE, SAMPLED, Context, Measured, _minillama
from .shapes import random_llama
from .task import Task, TaskConfig, WordTokenizer, check_fits, make_task, plain_prompt_ids


RUNNERS: dict[str, Callable[..., Measured]] = {
    "independent": _minillama("independent", True),
    "independent_plain": _minillama("independent", False),
    "batched": _minillama("batched", True),
    "seqbatch": _minillama("seqbatch", True),
    "parallel": _minillama("parallel", True),
    "parallel_plain": _minillama("parallel", False),
    "hf_batched": hf_batched,
    "hf_prefix": hf_prefix,
    "llamacpp": llamacpp,  # imports llama-cpp-python (optional) when it runs
}



@dataclass
class Case:
    sweep: str
    task: TaskConfig
    methods: tuple[str, ...]
    sample: int | None = None  # run SAMPLED methods on this many questions and scale
    once: tuple[str, ...] = ()  # methods run in the first repeat only (long ones)
    parallel_size: int | None = None
    batch_docs: int | None = None
    label: str = ""


def _sample(task: Task, k: int | None) -> list[int]:
    """k question indices spread evenly over all questions (and so over the documents)."""
    n = task.n
    if k is None or k >= n:
        return list(range(n))
    return sorted({round(j * n / k) for j in range(k)})


def _flops(cost: CostModel, method: str, task: Task, idx: list[int]) -> float:
    """The FLOPs a method executes on questions `idx`: the plain-kernel variants do the same work."""
    prompts, docs, g = [task.prompts[i] for i in idx], [task.docs[i] for i in idx], task.config.new_tokens
    if method in ("independent", "independent_plain", "batched"):
        return cost.independent(prompts, g)
    if method in ("parallel", "parallel_plain"):
        return cost.parallel(prompts, docs, g)["total"]
    if method == "llamacpp":
        # llama.cpp also evaluates each shared prefix once per context (past its cap on sequences, a
        # document's prefix again in every context its questions run in); the scores its kernels compute
        # and mask out in its one cache of all sequences are not counted.
        return sum(cost.parallel([task.prompts[i] for i in part], [task.docs[i] for i in part], g)["total"]
                   for part in chunks(idx))
    if method == "seqbatch":
        return cost.seqbatch(prompts, docs, g)
    if method == "hf_batched":
        return cost.hf_batched(prompts, g)
    if method == "hf_prefix":
        return cost.hf_prefix(prompts, docs, g)
    raise ValueError(f"no cost model for method {method!r}")


def run_case(ctx: Context, case: Case, task: Task, repeats: int, reference: dict[tuple[int, tuple[int, ...]], list[int]],
             gemm: list[float], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Run every method of the case `repeats` times, round-robin; one record per method (medians).

    `reference` maps (new tokens, prompt) to the prompt's `independent` answer; it fills as independent runs
    and is what the identity column is checked against, across cases.
    """
    cost = CostModel(ctx.model.config)
    g = case.task.new_tokens
    useful = cost.parallel(task.prompts, task.docs, g)
    per: dict[str, list[Measured]] = {m: [] for m in case.methods}
    idx_of = {m: (_sample(task, case.sample) if m in SAMPLED else list(range(task.n))) for m in case.methods}
    # A long run-once method made of separate runs (each question alone) is cut into `repeats` slices, one
    # per round, so that it meets the same machine weather as the repeated methods it is compared with.
    sliced = {m: [idx_of[m][k::repeats] for k in range(repeats)] for m in case.once if m in ADDITIVE and m in per}
    c = ctx.model.config
    for r in range(repeats):
        gemm.append(gemm_rate(k=c.hidden_size, n=c.intermediate_size))  # a GEMM at the model's MLP shape
        for m in case.methods:
            if m in sliced:
                idx = sliced[m][r]
            elif m in case.once and r > 0:
                continue
            else:
                idx = idx_of[m]
            if not idx:
                continue
            kw = {"parallel_size": case.parallel_size, "batch_docs": case.batch_docs} if m in (
                "parallel", "hf_prefix") else {}
            res = RUNNERS[m](ctx, task, idx, **kw)
            per[m].append(res)
            if m == "independent":
                for i, a in res.answers.items():
                    reference.setdefault((g, tuple(task.prompts[i])), a)
            log(f"  {case.sweep} {case.label} {m} {'slice' if m in sliced else 'repeat'} {r + 1}/{repeats}: "
                f"{res.prefill_s + res.decode_s:.2f} s ({len(idx)} questions)")
    for m in sliced:
        per[m] = [Measured.combine(per[m])]
    rate = statistics.median(gemm[-repeats:]) * 1e9
    par_answers = per["parallel"][0].answers if per.get("parallel") else None
    records = []
    for m in case.methods:
        runs, idx = per[m], idx_of[m]
        scale = task.n / len(idx)
        med = lambda f: statistics.median(f(x) for x in runs)  # noqa: E731
        prefill, decode = med(lambda x: x.prefill_s) * scale, med(lambda x: x.decode_s) * scale
        wall = med(lambda x: x.prefill_s + x.decode_s) * scale
        answers = runs[0].answers
        ref = {i: reference.get((g, tuple(task.prompts[i]))) for i in idx}
        checked = [i for i in idx if ref[i] is not None]
        eos = ctx.model.config.eos_token_ids
        correct = sum(task.colors[i] in _answer_text(ctx.tokenizer, answers[i], eos).lower() for i in idx)
        stable = all(x.answers == answers for x in runs)
        flops = _flops(cost, m, task, idx) * scale
        kv_scale = scale if m in ("batched", "hf_batched") else 1.0
        rec = {
            "sweep": case.sweep, "label": case.label, **dataclasses.asdict(case.task),
            "doc_tokens_real": _mean_shared(task), "prompt_tokens_mean": statistics.mean(map(len, task.prompts)),
            "suffix_tokens_mean": statistics.mean(map(len, task.prompts)) - _mean_shared(task),
            "question_text_tokens_mean": statistics.mean(len(ctx.tokenizer.encode(q)) for q in task.questions),
            "questions": task.n, "method": m, "parallel_size": case.parallel_size, "batch_docs": case.batch_docs,
            "measured_questions": len(idx), "extrapolated": len(idx) < task.n, "repeats": len(runs),
            "wall_s": wall, "prefill_s": prefill, "decode_s": decode, "cpu_s": med(lambda x: x.cpu_s) * scale,
            "setup_s": med(lambda x: x.setup_s),  # untimed, outside wall_s
            "wall_s_min": min(x.prefill_s + x.decode_s for x in runs) * scale,
            "generated_tokens": task.n * g, "tokens_per_s": task.n * g / wall if wall else float("nan"),
            "decode_steps": runs[0].decode_steps, "forward_passes": runs[0].forward_passes,
            "decode_s_per_step": (med(lambda x: x.decode_s) / runs[0].decode_steps
                                  if runs[0].decode_steps and m not in SAMPLED else None),
            "kv_bytes": int(max(x.kv_bytes for x in runs) * kv_scale),
            "peak_rss_bytes": max(x.rss_bytes for x in runs),
            "accuracy": correct / len(idx),
            "identical_to_independent": sum(answers[i] == ref[i] for i in checked),
            "checked_against_independent": len(checked),
            # parallel runs every question and is the independent answer bit for bit (tests/test_parity.py):
            # the comparison that covers all questions when the sampled reference covers a few
            "identical_to_parallel": sum(answers[i] == par_answers[i] for i in idx) if par_answers else None,
            "checked_against_parallel": len(idx) if par_answers else 0,
            "stable_across_repeats": stable,
            "flops_executed": flops, "flops_useful": useful["total"],
            "gemm_gflops": rate / 1e9, **flop_rates(useful["total"], flops, wall, rate / 1e9),
            "contexts": runs[0].contexts,
        }
        if m == "parallel":
            rec["prefill_flops"] = useful["prefill"]
            rec["prefill_frac_of_gemm"] = useful["prefill"] / prefill / rate if prefill else float("nan")
            rec["decode_flops_per_step"] = useful["decode"] / max(g - 1, 1) if g > 1 else 0.0
            # What `batched` would hold at its peak (every prompt and g - 1 answer tokens, each its own copy):
            # exact, as the cache stores one slot per token.
            per_token = c.kv_bytes_per_token(ctx.model.dtype.itemsize)
            rec["kv_bytes_batched_equiv"] = per_token * sum(len(p) + g - 1 for p in task.prompts)
        records.append(rec)
    base = {r["method"]: r["wall_s"] for r in records}
    for r in records:
        for ref_m in ("independent_plain", "independent", "hf_batched"):
            if ref_m in base:
                r[f"speedup_vs_{ref_m}"] = base[ref_m] / r["wall_s"]
    return records




def _mean_shared(task: Task) -> float:
    out = []
    for d in dict.fromkeys(task.docs):
        group = [p for p, dd in zip(task.prompts, task.docs) if dd == d]
        out.append(shared_prefix_length(group) if len(group) > 1 else len(group[0]) - 1)
    return statistics.mean(out)


def _answer_text(tokenizer: Any, ids: list[int], eos: Sequence[int] = ()) -> str:
    """The answer's text up to its first EOS (EOS is ignored while generating, so text follows it)."""
    cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
    return tokenizer.decode(ids[:cut])


def setup(model_path: str | None, random_shape: LlamaConfig | None, hf: bool, workdir: Path) -> Context:
    """The model, its tokenizer and (with hf) an HF directory holding the same weights."""
    if random_shape is not None:
        model = random_llama(random_shape)
        tok = WordTokenizer(random_shape.vocab_size)
        hf_path = None
        if hf:
            from ..weights import save_hf_dir

            hf_path = str(save_hf_dir(random_shape, model.state_dict(), None, workdir / "hf_random"))
        return Context(model, tok, hf_path, checkpoint=None, workdir=workdir)
    from ..weights import default_model_dir, load_model
    from ..weights.hf import _is_hf_dir

    model, tok = load_model(model_path)
    path = Path(model_path) if model_path else default_model_dir()
    hf_path = str(path) if hf and path.is_dir() and _is_hf_dir(path) else None
    if hf and hf_path is None:
        from ..weights import save_hf_dir

        hf_path = str(save_hf_dir(model.config, model.state_dict(), None, workdir / "hf_copy"))
    return Context(model, tok, hf_path, checkpoint=str(path), workdir=workdir)


def run(cases: list[Case], ctx: Context, repeats: int, log: Callable[[str], None] = print) -> tuple[list, list]:
    reference: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    gemm: list[float] = []
    records = []
    tasks = [make_task(ctx.tokenizer, case.task, plain_prompt_ids(ctx.tokenizer)) for case in cases]
    for case, task in zip(cases, tasks):  # every case checked before any runs (hours in, in a full sweep)
        check_fits(task, case.task.new_tokens, ctx.model.config.context,
                   f"the {case.sweep} case {case.label or case.task.doc_tokens}")
    # Independent first in each case, so that every later method is checked against it.
    for case, task in zip(cases, tasks):
        case.methods = tuple(sorted(case.methods, key=lambda m: m != "independent"))
        records += run_case(ctx, case, task, repeats, reference, gemm, log)
    return records, gemm
