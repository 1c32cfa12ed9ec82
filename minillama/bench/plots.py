"""PNG plots of a run's records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..files import write_file
from .methods import METHODS


def plot(out: Path, records: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        write_file(out / name, lambda f: fig.savefig(f, dpi=110, format="png"))
        plt.close(fig)
        paths.append(out / name)

    rows = [r for r in records if r["sweep"] == "headline"]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 3.6))
        names = [r["method"] for r in rows]
        ax.barh(names, [r["prefill_s"] for r in rows], color="C0", label="prefill")
        ax.barh(names, [r["decode_s"] for r in rows], left=[r["prefill_s"] for r in rows], color="C1",
                label="decode")
        base = next((r["wall_s"] for r in rows if r["method"] == "independent_plain"), None)
        for i, r in enumerate(rows):
            note = f" {r['wall_s']:.1f} s" + (f"  ({base / r['wall_s']:.1f}x)" if base else "")
            ax.text(r["wall_s"], i, note, va="center", fontsize=8)
        ax.set_xlim(0, 1.25 * max(r["wall_s"] for r in rows))
        ax.set_xlabel("generation time, s" + ("  (speedup vs independent_plain)" if base else ""))
        c = rows[0]
        ax.set_title(f"{c['questions']} questions, doc {c['doc_tokens']} tokens, {c['new_tokens']} new tokens")
        ax.invert_yaxis()
        ax.legend(loc="lower right")
        save(fig, "headline.png")

    def lines(sweep: str, x: str, name: str, xlabel: str, logx: bool = False) -> None:
        rows = [r for r in records if r["sweep"] == sweep]
        if not rows:
            return
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        for m in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r[x], r["wall_s"], r.get("speedup_vs_independent_plain")) for r in rows if r["method"] == m)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[m], label=m)
            if m != "independent_plain" and all(p[2] for p in pts):
                a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=colors[m], label=m)
        xs = sorted({r[x] for r in rows})
        for a in (a1, a2):
            a.set_xlabel(xlabel)
            if logx:
                a.set_xscale("log", base=2)
            a.set_xticks(xs, [str(v) for v in xs])
            a.minorticks_off()
        a1.set_yscale("log")
        a1.set_ylabel("generation time, s")
        a2.set_ylabel("speedup vs independent (plain)")
        a1.legend(fontsize=8)
        a2.legend(fontsize=8)
        save(fig, name)

    lines("docs", "n_docs", "docs.png", "unique documents")
    lines("doclen", "doc_tokens", "doclen.png", "document tokens", logx=True)
    lines("questions", "questions_per_doc", "questions.png", "questions per document", logx=True)

    par = sorted((r for r in records if r["sweep"] == "doclen" and r["method"] == "parallel"
                  and r["decode_s_per_step"]), key=lambda r: r["doc_tokens"])
    if len(par) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        x = [r["doc_tokens"] for r in par]
        t0, f0 = par[0]["decode_s_per_step"], par[0]["decode_flops_per_step"]
        ax.plot(x, [r["decode_s_per_step"] / t0 for r in par], "o-", label="parallel decode time per step")
        ax.plot(x, [r["decode_flops_per_step"] / f0 for r in par], "k--", label="decode FLOPs per step")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.set_xlabel("document tokens")
        ax.set_ylabel(f"relative to doc {x[0]}")
        ax.set_title(f"{par[0]['questions']} questions decoding together")
        ax.legend(fontsize=8)
        save(fig, "decode_step.png")

    many = [r for r in records if r["sweep"] == "many" and not r["extrapolated"]]
    if many:  # generated tok/s and the useful FLOP rate against questions, one line per method
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        for m in dict.fromkeys(r["method"] for r in many):
            pts = sorted((r["questions"], r["tokens_per_s"], 100 * r["useful_frac_of_gemm"]) for r in many
                         if r["method"] == m)
            a1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[m], label=m)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=colors[m], label=m)
        xs = sorted({r["questions"] for r in many})
        for a in (a1, a2):
            a.set_xscale("log", base=2)
            a.set_xticks(xs, [str(v) for v in xs])
            a.minorticks_off()
            a.set_xlabel("questions about one document")
            a.legend(fontsize=8)
        a1.set_ylabel("generated tokens / s")
        a2.set_ylabel("useful FLOP/s, % of the GEMM rate")
        m0 = many[0]
        a1.set_title(f"doc {m0['doc_tokens']} tokens, {m0['new_tokens']} new tokens")
        save(fig, "many.png")

    grid = [r for r in records if r["sweep"] == "grid"]
    if grid:
        bds = sorted({r["batch_docs"] for r in grid})
        pss = sorted({r["parallel_size"] for r in grid})
        t = [[next((r["wall_s"] for r in grid if r["batch_docs"] == b and r["parallel_size"] == p), float("nan"))
              for p in pss] for b in bds]
        fig, ax = plt.subplots(figsize=(5, 3.6))
        im = ax.imshow(t, cmap="viridis_r")
        ax.set_xticks(range(len(pss)), [str(p) for p in pss])
        ax.set_yticks(range(len(bds)), [str(b) for b in bds])
        ax.set_xlabel("parallel size (questions per document per wave)")
        ax.set_ylabel("batch size (documents per pass)")
        for i in range(len(bds)):
            for j in range(len(pss)):
                ax.text(j, i, f"{t[i][j]:.3g}", ha="center", va="center", color="w")
        fig.colorbar(im, label="generation time, s")
        g0 = grid[0]
        ax.set_title(f"{g0['n_docs']} docs x {g0['questions_per_doc']} questions")
        save(fig, "grid.png")
    return paths
