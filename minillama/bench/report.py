"""Output: the headline table, the findings against the targets, JSON, CSV and markdown."""

from __future__ import annotations

import csv
import io
import math
import tempfile
from pathlib import Path
from typing import Any

from ..files import json_text, make_dir, write_file
from .plots import plot


def _fmt(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{nd}f}" if abs(x) < 1e5 else f"{x:.3g}"
    return str(x)


def headline_table(records: list[dict[str, Any]]) -> str:
    rows = [r for r in records if r["sweep"] == "headline"]
    if not rows:
        return ""
    # the column names the method it divides by: independent with plain kernels where that ran, else the first
    base = next((r for r in rows if r["method"] == "independent_plain"), rows[0])
    versus = "independent (plain)" if base["method"] == "independent_plain" else base["method"].replace("_", " ")
    hf = next((r for r in rows if r["method"] == "hf_batched"), None)
    head = (f"| method | wall s | prefill s | decode s | CPU s | tok/s | speedup vs {versus} | vs HF batched "
            "| KV MiB | peak RSS MiB | exact match | identical to independent | same tokens as parallel "
            "| useful FLOP/s % of GEMM |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["method"] + (f" (x{r['questions'] / r['measured_questions']:.0f} from {r['measured_questions']} q)"
                           if r["extrapolated"] else ""),
            _fmt(r["wall_s"]), _fmt(r["prefill_s"]), _fmt(r["decode_s"]), _fmt(r["cpu_s"]), _fmt(r["tokens_per_s"], 1),
            _fmt(base["wall_s"] / r["wall_s"], 1), _fmt(hf["wall_s"] / r["wall_s"], 1) if hf else "-",
            _fmt(r["kv_bytes"] / 2**20, 1), _fmt(r["peak_rss_bytes"] / 2**20, 0),
            f"{r['accuracy'] * 100:.0f}%",
            f"{r['identical_to_independent']}/{r['checked_against_independent']}",
            f"{r['identical_to_parallel']}/{r['checked_against_parallel']}" if r.get("checked_against_parallel")
            else "-",
            _fmt(100 * r["useful_frac_of_gemm"], 1)]) + " |")
    return "\n".join(lines)


def findings(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets of the brief, measured (reported, never asserted)."""
    out: dict[str, Any] = {}
    h = {r["method"]: r for r in records if r["sweep"] == "headline"}
    if "parallel" in h:
        p = h["parallel"]
        for m in ("independent_plain", "independent", "hf_batched", "hf_prefix", "llamacpp", "batched", "seqbatch",
                  "parallel_plain"):
            if m in h:
                out[f"parallel_speedup_vs_{m}"] = h[m]["wall_s"] / p["wall_s"]
        # The same ratios in process CPU time: with one thread, time lost to other processes on a shared
        # machine is not counted, so these move less from run to run than the wall-clock ones.
        for m in ("independent_plain", "hf_batched", "llamacpp"):
            if m in h:
                out[f"parallel_speedup_vs_{m}_cpu_time"] = h[m]["cpu_s"] / p["cpu_s"]
        if "batched" in h:
            out["kv_parallel_over_batched"] = p["kv_bytes"] / h["batched"]["kv_bytes"]
        if "hf_batched" in h:
            out["kv_parallel_over_hf_batched"] = p["kv_bytes"] / h["hf_batched"]["kv_bytes"]
        out["parallel_prefill_frac_of_gemm"] = p.get("prefill_frac_of_gemm")
        out["gemm_gflops"] = p["gemm_gflops"]
    d = {r["doc_tokens"]: r for r in records if r["sweep"] == "doclen" and r["method"] == "parallel"}
    if 512 in d and 4096 in d and d[512]["decode_s_per_step"]:
        t = d[4096]["decode_s_per_step"] / d[512]["decode_s_per_step"]
        f = d[4096]["decode_flops_per_step"] / d[512]["decode_flops_per_step"]
        out.update(decode_step_s_512=d[512]["decode_s_per_step"], decode_step_s_4096=d[4096]["decode_s_per_step"],
                   decode_step_time_growth=t, decode_step_flops_growth=f, decode_growth_over_flops_growth=t / f,
                   doclen_questions=d[4096]["questions"])
    for L, r in sorted(d.items()):
        out[f"kv_parallel_over_batched_doc{L}"] = r["kv_bytes"] / r["kv_bytes_batched_equiv"]
    lc = {r["doc_tokens"]: r for r in records if r["sweep"] == "doclen" and r["method"] == "llamacpp"}
    for L in sorted(set(d) & set(lc)):
        out[f"parallel_speedup_vs_llamacpp_doc{L}"] = lc[L]["wall_s"] / d[L]["wall_s"]
    if 4096 in d and 4096 in lc:
        out["parallel_speedup_vs_llamacpp_long_doc"] = out["parallel_speedup_vs_llamacpp_doc4096"]
    many = {(r["questions"], r["method"]): r for r in records if r["sweep"] == "many"}
    for (q, m), r in sorted(many.items()):
        if m == "parallel":
            out[f"parallel_tokens_per_s_q{q}"] = r["tokens_per_s"]
            out[f"parallel_useful_frac_of_gemm_q{q}"] = r["useful_frac_of_gemm"]
            if (q, "llamacpp") in many:
                out[f"parallel_speedup_vs_llamacpp_q{q}"] = many[(q, "llamacpp")]["wall_s"] / r["wall_s"]
    table3 = [out[f"parallel_useful_frac_of_gemm_q{q}"] for q in TABLE3 if f"parallel_useful_frac_of_gemm_q{q}" in out]
    if len(table3) == len(TABLE3):
        out["parallel_useful_frac_of_gemm_table3"] = min(table3)
    if "parallel_tokens_per_s_q256" in out and "parallel_tokens_per_s_q1024" in out:
        out["parallel_tokens_per_s_1024_over_256"] = (out["parallel_tokens_per_s_q1024"]
                                                      / out["parallel_tokens_per_s_q256"])
    for r in records:  # llama.cpp is another program: its tokens, not its bits, can match
        if r["method"] == "llamacpp" and r.get("checked_against_parallel"):
            where = ("" if r["sweep"] == "headline" else f"_many_q{r['questions']}" if r["sweep"] == "many"
                     else f"_{r['sweep']}_doc{r['doc_tokens']}")
            out[f"llamacpp_same_tokens_as_parallel{where}"] = (f"{r['identical_to_parallel']}/"
                                                               f"{r['checked_against_parallel']}")
    if 4096 in d:
        # The KV target is about long documents: at 512 tokens the 64 questions' own tokens (prompt suffix and
        # answer, about 20 each) are already 1/30 of batched's cache, whatever the method does with the document.
        out["kv_parallel_over_batched_long_doc"] = out["kv_parallel_over_batched_doc4096"]
    return out


# The paper's Table 3 sizes: questions about one 512-token document.
TABLE3 = (128, 256, 512)

# The brief's targets: (finding, comparison, bound, what it means). Reported, never asserted.
TARGETS = [
    ("parallel_speedup_vs_independent_plain", ">=", 10.0, "parallel >= 10x faster than independent (plain ops)"),
    ("parallel_speedup_vs_hf_batched", ">=", 8.0, "parallel >= 8x faster than HF batched generate"),
    ("decode_growth_over_flops_growth", "<=", 1.2, "doc 512 -> 4096: decode time per step grows <= 1.2x FLOPs"),
    ("kv_parallel_over_batched_long_doc", "<=", 1 / 32, "doc 4096, 64 questions: parallel KV bytes <= 1/32 of batched"),
    ("parallel_prefill_frac_of_gemm", ">=", 0.5, "parallel prefill >= 50% of the GEMM rate"),
    ("parallel_speedup_vs_llamacpp", ">=", 1.5, "parallel >= 1.5x faster than llama.cpp's shared-prefix batches (F32)"),
    ("parallel_speedup_vs_llamacpp_long_doc", ">=", 2.0, "doc 4096, 64 questions: parallel >= 2x faster than llama.cpp"),
    ("parallel_speedup_vs_llamacpp_q256", ">=", 1.5, "Table 3, 256 questions: parallel >= 1.5x faster than llama.cpp"),
    ("parallel_useful_frac_of_gemm_table3", ">=", 0.5,
     "Table 3 sizes (128-512 questions): useful FLOP rate >= 50% of the GEMM rate, at each"),
    ("parallel_tokens_per_s_1024_over_256", ">=", 0.95,
     "generated tok/s holds level from 256 to 1,024 questions (within 5%)"),
]


def target_rows(found: dict[str, Any], measured_only: bool = False) -> list[tuple[str, str, str]]:
    rows = []
    for key, op, bound, text in TARGETS:
        v = found.get(key)
        if v is None:
            if not measured_only:
                rows.append((text, "not measured in this preset", "-"))
        else:
            met = v >= bound if op == ">=" else v <= bound
            rows.append((text, _fmt(v, 3), "met" if met else "missed"))
    return rows


def write_outputs(out: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> list[Path]:
    """results.json, results.csv, summary.md and the plots under `out`; the plot paths. Every file is made
    before the first is written: records or meta that lack what the tables need (KeyError, TypeError, ...)
    leave `out` as it was, an earlier run's files included."""
    found = findings(records)
    results = json_text({"meta": meta, "findings": found, "records": records}, indent=1, default=str) + "\n"
    keys = list(dict.fromkeys(k for r in records for k in r))
    csv_text = io.StringIO(newline="")
    w = csv.DictWriter(csv_text, fieldnames=keys)
    w.writeheader()
    w.writerows(records)
    md = [f"# minillama bench ({meta['preset']})", "", f"commit {meta.get('commit', '?')}; model: {meta['model']}; GEMM "
          f"{meta['gemm_gflops']:.1f} GFLOP/s; threads {meta['threads']}", "", headline_table(records), "",
          "## Targets (measured, not asserted)", "", "| target | measured | |", "|---|---|---|"]
    md += [f"| {t} | {v} | {m} |" for t, v, m in target_rows(found)]
    md += ["", "## Findings", "", "| quantity | value |", "|---|---|"]
    md += [f"| {k} | {_fmt(v, 3)} |" for k, v in found.items()]
    for sweep in ("answer16", "docs", "doclen", "grid", "questions"):
        rows = [r for r in records if r["sweep"] == sweep]
        if rows:
            md += ["", f"## {sweep}", "", "| point | method | wall s | prefill s | decode s | speedup vs indep. plain |"
                   " KV MiB | exact match | identical |", "|---|---|---|---|---|---|---|---|---|"]
            md += [f"| {r['label']} | {r['method']} | {_fmt(r['wall_s'])} | {_fmt(r['prefill_s'])} | "
                   f"{_fmt(r['decode_s'])} | {_fmt(r.get('speedup_vs_independent_plain'), 1)} | "
                   f"{_fmt(r['kv_bytes'] / 2**20, 1)} | {r['accuracy'] * 100:.0f}% | "
                   f"{r['identical_to_independent']}/{r['checked_against_independent']} |" for r in rows]
    if any(r["sweep"] == "many" for r in records):
        md += ["", "## many: one document, many questions (Table 3 from 128)", "", many_table(records)]
    # The plots are drawn before anything is written, in a folder of their own inside `out` (its disk).
    with tempfile.TemporaryDirectory(prefix=".plots.tmp-", dir=make_dir(out)) as scratch:
        pngs = {p.name: p.read_bytes() for p in plot(Path(scratch), records)}
    for name, data in {"results.json": results, "results.csv": csv_text.getvalue(), "summary.md": "\n".join(md) + "\n",
                       **pngs}.items():
        write_file(out / name, data)
    return [out / name for name in pngs]


def many_table(records: list[dict[str, Any]]) -> str:
    """The many-questions sweep: per question count and method, the times, generated tokens per second,
    the useful FLOP rate against the GEMM rate of the same run, and the tokens compared with parallel's."""
    order = {"parallel": 0, "llamacpp": 1}
    rows = sorted((r for r in records if r["sweep"] == "many"), key=lambda r: (r["questions"], order.get(r["method"], 2)))
    par = {r["questions"]: r for r in rows if r["method"] == "parallel"}
    head = ("| questions | method | contexts | wall s | prefill s | decode s | generated tok/s | useful GFLOP/s "
            "| useful % of GEMM | executed % of GEMM | parallel is faster by | same tokens as parallel "
            "| identical to independent |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = par.get(r["questions"])
        lines.append("| " + " | ".join([
            str(r["questions"]), r["method"] + (f" (x{r['questions'] / r['measured_questions']:.0f} from "
                                                 f"{r['measured_questions']} q)" if r["extrapolated"] else ""),
            str(r.get("contexts", 1)), _fmt(r["wall_s"]), _fmt(r["prefill_s"]), _fmt(r["decode_s"]),
            _fmt(r["tokens_per_s"], 1), _fmt(r["useful_gflops"], 1), _fmt(100 * r["useful_frac_of_gemm"], 1),
            _fmt(100 * r["executed_frac_of_gemm"], 1),
            _fmt(r["wall_s"] / p["wall_s"], 2) if p and r is not p else "-",
            f"{r['identical_to_parallel']}/{r['checked_against_parallel']}" if r.get("checked_against_parallel")
            else "-",
            f"{r['identical_to_independent']}/{r['checked_against_independent']}"]) + " |")
    gemm = sorted({round(r["gemm_gflops"], 1) for r in rows})
    return "\n".join(lines) + (f"\n\nGEMM rate in the run (a fp32 matmul at the model's MLP shape): "
                               f"{gemm[0]:.1f}-{gemm[-1]:.1f} GFLOP/s." if gemm else "")


# ------------------------------------------------------------------------------------------------------
# The README's performance table, rendered from a results.json so that it is never copied by hand

README_START = "<!-- bench-table: generated by `python -m minillama.bench --from-json docs/bench/results.json --readme README.md` -->"
README_END = "<!-- /bench-table -->"

LABELS = {
    "independent": "independent (invariant kernels)",
    "independent_plain": "independent, plain kernels (`invariant=False`)",
    "batched": "batched (document KV stored per question)",
    "seqbatch": "seqbatch (one stream: q1, a1, q2, ...)",
    "parallel": "**parallel**",
    "parallel_plain": "parallel, plain kernels",
    "hf_batched": "HF transformers `generate`, batched, left-padded",
    "hf_prefix": "HF transformers with a reused prefix cache",
    "llamacpp": "llama.cpp, shared prefix once in one cache (seq_cp)",
}
# Whether a method's logits are the bits of the independent run. The bench compares generated tokens; the
# bits are what tests/test_parity.py checks (`torch.equal` on every step's logits) for the packed modes.
BITS = {
    "independent": "the reference",
    "batched": "same bits (tested)",
    "parallel": "same bits (tested)",
    "seqbatch": "no: other context",
    "llamacpp": "no: another program",
}


def readme_table(data: dict[str, Any]) -> str:
    """The headline case of a results.json as the README shows it: what each method ran on (all questions,
    or a sample whose times were scaled), medians, the ratio to parallel, KV bytes, and the identity column
    split honestly into tokens (what the bench compares) and bits (what the parity tests prove)."""
    rows = [r for r in data["records"] if r["sweep"] == "headline"]
    meta = data["meta"]
    if not rows:
        raise ValueError("results.json has no headline case")
    par = next(r for r in rows if r["method"] == "parallel")
    n = par["questions"]
    scaled = [r for r in rows if r["extrapolated"]]
    whole = [r for r in rows if not r["extrapolated"]]
    gemm = meta.get("gemm_gflops_all") or [meta["gemm_gflops"]]
    sample = ", ".join(f"{r['method']} ({r['measured_questions']} of {n})" for r in scaled)
    lines = [
        f"Model {meta['model']}, {meta['threads']} thread(s), torch {meta.get('torch', '?')}, commit "
        f"{meta.get('commit', '?')}; document {par['doc_tokens_real']:.0f} tokens, {n} questions "
        f"({par['suffix_tokens_mean']:.0f} prompt tokens each after the shared prefix), {par['new_tokens']} new tokens (EOS ignored). "
        f"Measured on all {n} questions: {', '.join(r['method'] for r in whole)} (median of "
        f"{max(r['repeats'] for r in whole)} repeats)."
        + (f" Measured on a sample of the questions, run once, times multiplied by {n} / sample: {sample}."
           if scaled else "")
        + f" GEMM rate during the run: {min(gemm):.0f}-{max(gemm):.0f} GFLOP/s: read ratios, not seconds.",
        "",
        f"    {meta.get('command', 'python -m minillama.bench')}",
        "",
        "| method | questions run | wall s | prefill s | decode s | parallel is faster by | KV MiB "
        "| same tokens as independent | same bits as independent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m, bold = r["method"], r["method"] == "parallel"
        cell = (lambda s: f"**{s}**") if bold else (lambda s: s)
        ran = (f"{r['measured_questions']} of {n}, x{n / r['measured_questions']:g}" if r["extrapolated"] else f"{n}")
        lines.append("| " + " | ".join([
            LABELS.get(m, m), ran, cell(f"{r['wall_s']:.1f}"), cell(f"{r['prefill_s']:.1f}"),
            cell(f"{r['decode_s']:.1f}"), "1x" if bold else f"{r['wall_s'] / par['wall_s']:.1f}x",
            cell(f"{r['kv_bytes'] / 2**20:.1f}"),
            f"{r['identical_to_independent']}/{r['checked_against_independent']}",
            BITS.get(m, "no: other kernels")]) + " |")
    lines += ["", "Against the targets (reported, never asserted):", "", "| target | measured | |", "|---|---|---|"]
    # The targets the run measured (a run without a peer installed says nothing about it).
    lines += [f"| {t} | {v} | {m} |" for t, v, m in target_rows(data.get("findings", {}), measured_only=True)]
    return "\n".join(lines)


def readme_text(path: Path, data: dict[str, Any]) -> tuple[str, str]:
    """The README's text, and that text with the table between its markers rendered from `data`."""
    text = path.read_text()
    if README_START not in text or README_END not in text:
        raise ValueError(f"{path}: no bench-table markers ({README_START!r} ... {README_END!r})")
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    return text, f"{head}{README_START}\n{readme_table(data)}\n{README_END}{tail}"


def update_readme(path: Path, data: dict[str, Any]) -> bool:
    """Replace the table between the README's markers; True if the file changed."""
    text, new = readme_text(path, data)
    write_file(path, new)
    return new != text
